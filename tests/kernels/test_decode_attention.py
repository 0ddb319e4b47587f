"""Paged split-KV decode attention vs the torch reference."""

from __future__ import annotations

import pytest
import torch

from common.kernels.decode_attention import decode_attention, decode_attention_reference

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# (page_size, group, head_dim, dtype): every value of each dimension appears, and the small
# page sizes meet the long sequence (70 tokens = 70 / 14 / 5 pages) in both dtypes.
CASES = [
    pytest.param(1, 1, 64, F32, id="ps1-g1-d64-f32"),
    pytest.param(16, 4, 128, F32, id="ps16-g4-d128-f32"),
    pytest.param(5, 4, 64, F16, id="ps5-g4-d64-f16"),
    pytest.param(16, 1, 128, F16, id="ps16-g1-d128-f16"),
    pytest.param(5, 1, 128, F32, id="ps5-g1-d128-f32"),
    pytest.param(1, 4, 128, F16, id="ps1-g4-d128-f16"),
    pytest.param(16, 4, 128, BF16, id="ps16-g4-d128-bf16", marks=pytest.mark.gpu),
    pytest.param(5, 1, 64, BF16, id="ps5-g1-d64-bf16", marks=pytest.mark.gpu),
]
NUM_KV_HEADS = 2


def _check(make_paged_kv, tol, device, lens, page_size, group, head_dim, dtype, **kwargs):
    paged = make_paged_kv(lens, page_size, NUM_KV_HEADS, head_dim, dtype, **kwargs)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(len(lens), NUM_KV_HEADS * group, head_dim, generator=gen).to(dtype).to(device)
    scale = head_dim**-0.5
    args = (q, paged.k_cache, paged.v_cache, paged.page_table, paged.seq_lens, scale)
    out = decode_attention(*args)
    ref = decode_attention_reference(*args)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not out.isnan().any(), "read a slot no sequence wrote"
    torch.testing.assert_close(out.float(), ref.float(), **tol(dtype))


@pytest.mark.parametrize(("page_size", "group", "head_dim", "dtype"), CASES)
def test_ragged_batch(make_paged_kv, tol, device, page_size, group, head_dim, dtype):
    _check(make_paged_kv, tol, device, [1, 17, 70], page_size, group, head_dim, dtype)


@pytest.mark.parametrize(
    ("lens", "page_size", "width"),
    [
        pytest.param([70], 5, 64, id="one-long-wide-table"),  # many splits, most of them empty
        pytest.param([1], 16, None, id="one-token-one-split"),  # one split: no reduce kernel
        pytest.param([3, 70, 1, 33, 16], 16, 8, id="five-seqs"),
        pytest.param([16, 32], 16, None, id="page-aligned"),
    ],
)
def test_shapes_and_splits(make_paged_kv, tol, device, lens, page_size, width):
    _check(make_paged_kv, tol, device, lens, page_size, 4, 64, F16, width=width, seed=3)


def test_strided_query(make_paged_kv, tol, device):
    """q as a view of a fused qkv row (the model's layout)."""
    paged = make_paged_kv([17, 70], 5, NUM_KV_HEADS, 64, F32)
    qkv = torch.randn(2, 8 + 2 * NUM_KV_HEADS, 64, device=device)
    q = qkv[:, :8]
    args = (q, paged.k_cache, paged.v_cache, paged.page_table, paged.seq_lens, 0.125)
    out = decode_attention(*args)
    torch.testing.assert_close(out, decode_attention_reference(*args), **tol(F32))
