"""Gathering a request's K/V into a transfer buffer and scattering it back."""

from __future__ import annotations

import pytest
import torch

from common.kernels.pack_kv import pack_kv, pack_kv_reference, unpack_kv, unpack_kv_reference

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# (token_start, num_tokens, page_size, num_kv_heads, head_dim, dtype)
CASES = [
    pytest.param(0, 1, 1, 2, 64, F32, id="s0-n1-ps1-h2-d64-f32"),
    pytest.param(3, 17, 16, 8, 128, F16, id="s3-n17-ps16-h8-d128-f16"),
    pytest.param(0, 70, 5, 2, 128, F32, id="s0-n70-ps5-h2-d128-f32"),
    pytest.param(11, 70, 1, 8, 64, F16, id="s11-n70-ps1-h8-d64-f16"),
    pytest.param(16, 70, 16, 3, 64, F32, id="s16-n70-ps16-h3-d64-f32"),  # Hkv*D not 2^k
    pytest.param(7, 70, 5, 8, 128, BF16, id="s7-n70-ps5-h8-d128-bf16", marks=pytest.mark.gpu),
]
PARAMS = ("start", "num_tokens", "page_size", "heads", "head_dim", "dtype")


@pytest.mark.parametrize(PARAMS, CASES)
def test_pack_matches_reference(
    make_paged_kv, start, num_tokens, page_size, heads, head_dim, dtype
):
    width = (start + num_tokens + page_size - 1) // page_size + 4
    paged = make_paged_kv([start + num_tokens], page_size, heads, head_dim, dtype, width=width)
    page_table = paged.page_table[0]  # padded past the request's pages with a NaN page
    args = (paged.k_cache, paged.v_cache, page_table, start, num_tokens)
    buffer = pack_kv(*args)
    assert buffer.shape == (2, num_tokens, heads, head_dim) and buffer.is_contiguous()
    assert not buffer.isnan().any(), "read a slot the request did not write"
    assert torch.equal(buffer, pack_kv_reference(*args))


@pytest.mark.parametrize(PARAMS, CASES)
def test_unpack_then_pack_round_trips(
    make_paged_kv, device, start, num_tokens, page_size, heads, head_dim, dtype
):
    paged = make_paged_kv([start + num_tokens], page_size, heads, head_dim, dtype, seed=5)
    page_table = paged.page_table[0]
    k_cache, v_cache = paged.k_cache, paged.v_cache
    # Erase the target tokens: afterwards NaN everywhere except the request's first `start`.
    nan_buffer = torch.full((2, num_tokens, heads, head_dim), float("nan"), dtype=dtype)
    unpack_kv_reference(nan_buffer.to(device), k_cache, v_cache, page_table, start)
    buffer = torch.randn(2, num_tokens, heads, head_dim).to(dtype).to(device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    unpack_kv(buffer, k_cache, v_cache, page_table, start)
    unpack_kv_reference(buffer, k_ref, v_ref, page_table, start)
    torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=0, equal_nan=True)  # nothing else
    torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=0, equal_nan=True)  # was written
    assert torch.equal(pack_kv(k_cache, v_cache, page_table, start, num_tokens), buffer)


def test_empty_request(make_paged_kv):
    """Zero tokens: pack gives an empty buffer and unpack writes no slot of either cache."""
    paged = make_paged_kv([5], 16, 2, 64, F32)
    page_table = paged.page_table[0]
    buffer = pack_kv(paged.k_cache, paged.v_cache, page_table, 5, 0)
    assert buffer.shape == (2, 0, 2, 64)
    assert torch.equal(buffer, pack_kv_reference(paged.k_cache, paged.v_cache, page_table, 5, 0))
    k_before, v_before = paged.k_cache.clone(), paged.v_cache.clone()
    unpack_kv(buffer, paged.k_cache, paged.v_cache, page_table, 5)
    torch.testing.assert_close(paged.k_cache, k_before, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(paged.v_cache, v_before, atol=0, rtol=0, equal_nan=True)
