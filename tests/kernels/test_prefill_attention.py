"""Ragged causal GQA flash attention vs the torch reference."""

from __future__ import annotations

import pytest
import torch

from common.kernels.prefill_attention import prefill_attention, prefill_attention_reference

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
NUM_KV_HEADS = 2

# (group, head_dim, dtype): every pair of values meets at least once.
CASES = [
    pytest.param(1, 64, F32, id="g1-d64-f32"),
    pytest.param(4, 128, F32, id="g4-d128-f32"),
    pytest.param(4, 64, F16, id="g4-d64-f16"),
    pytest.param(1, 128, F16, id="g1-d128-f16"),
    pytest.param(4, 128, BF16, id="g4-d128-bf16", marks=pytest.mark.gpu),
]


def _inputs(lens, group, head_dim, dtype, device, seed=0):
    """q, k, v: [T, H, D] views of NaN-padded buffers (reading past the batch shows as NaN)."""
    gen = torch.Generator().manual_seed(seed)
    total, pad = sum(lens), 40
    tensors = []
    for heads in (NUM_KV_HEADS * group, NUM_KV_HEADS, NUM_KV_HEADS):
        buf = torch.full((total + pad, heads, head_dim), float("nan"), dtype=dtype)
        buf[:total] = torch.randn(total, heads, head_dim, generator=gen).to(dtype)
        tensors.append(buf.to(device)[:total])
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    return (*tensors, cu)


def _check(tol, lens, group, head_dim, dtype, device):
    q, k, v, cu = _inputs(lens, group, head_dim, dtype, device)
    args = (q, k, v, cu, max(lens), head_dim**-0.5)
    out = prefill_attention(*args)
    ref = prefill_attention_reference(*args)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not out.isnan().any(), "read past the end of the batch"
    torch.testing.assert_close(out.float(), ref.float(), **tol(dtype))


@pytest.mark.parametrize(("group", "head_dim", "dtype"), CASES)
def test_ragged_batch(tol, device, group, head_dim, dtype):
    _check(tol, [1, 17, 70], group, head_dim, dtype, device)


@pytest.mark.parametrize(
    "lens",
    [
        pytest.param([1], id="one-token"),
        pytest.param([70], id="one-long"),
        pytest.param([32, 64, 5, 0, 33], id="block-aligned-and-empty"),
    ],
)
def test_lengths(tol, device, lens):
    _check(tol, lens, 4, 64, F16, device)


def test_max_seqlen_larger_than_needed(tol, device):
    """The grid is sized by max_seqlen; extra query blocks must do nothing."""
    q, k, v, cu = _inputs([17, 3], 1, 64, F32, device)
    out = prefill_attention(q, k, v, cu, 200, 0.125)
    torch.testing.assert_close(out, prefill_attention_reference(q, k, v, cu, 17, 0.125), **tol(F32))


def test_strided_fused_qkv(tol, device):
    """q, k, v as views of one fused [T, Hq + 2 Hkv, D] projection (the model's layout)."""
    lens, hq, hkv, d = [17, 40], 8, 2, 64
    qkv = torch.randn(sum(lens), hq + 2 * hkv, d, device=device)
    q, k, v = qkv.split([hq, hkv, hkv], dim=1)
    cu = torch.tensor([0, 17, 57], dtype=torch.int32, device=device)
    out = prefill_attention(q, k, v, cu, 40, 0.125)
    torch.testing.assert_close(out, prefill_attention_reference(q, k, v, cu, 40, 0.125), **tol(F32))
