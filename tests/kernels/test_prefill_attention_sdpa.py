"""The CPU backend's SDPA prefill attention (ragged, causal, GQA) vs the float32 reference."""

from __future__ import annotations

import pytest
import torch

from common.kernels.prefill_attention import prefill_attention_reference
from common.kernels.prefill_attention_sdpa import prefill_attention_sdpa

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
NUM_KV_HEADS = 2


def _check(tol, lens, group, head_dim, dtype):
    """q, k, v are views of NaN-padded buffers: reading past the batch shows as NaN."""
    gen = torch.Generator().manual_seed(0)
    total = sum(lens)
    tensors = []
    for heads in (NUM_KV_HEADS * group, NUM_KV_HEADS, NUM_KV_HEADS):
        buf = torch.full((total + 40, heads, head_dim), float("nan"), dtype=dtype)
        buf[:total] = torch.randn(total, heads, head_dim, generator=gen).to(dtype)
        tensors.append(buf[:total])
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    args = (*tensors, cu, max(lens), head_dim**-0.5)
    out = prefill_attention_sdpa(*args)
    ref = prefill_attention_reference(*args)
    assert out.shape == tensors[0].shape and out.dtype == dtype
    assert not out.isnan().any(), "read past the end of the batch"
    torch.testing.assert_close(out.float(), ref.float(), **tol(dtype))


@pytest.mark.parametrize("group", [1, 2, 4])
def test_odd_lengths_and_gqa(tol, group):
    _check(tol, [1, 17, 1025], group, 64, F32)


@pytest.mark.parametrize(
    "lens", [pytest.param([1], id="one-token"), pytest.param([32, 64, 5, 0, 33], id="empty")])
def test_lengths(tol, lens):
    _check(tol, lens, 4, 32, F32)


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_half_dtypes(tol, dtype):
    _check(tol, [1, 17, 70], 4, 64, dtype)
