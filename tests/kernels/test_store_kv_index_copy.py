"""The CPU backend's page store (one index_copy_ per cache) vs the torch reference: the same
slots written with the same bytes, everything else left as it was (NaN)."""

from __future__ import annotations

import pytest
import torch

from common.kernels.store_kv import store_kv_reference
from common.kernels.store_kv_index_copy import store_kv_index_copy


def _case(num_tokens, page_size, heads, head_dim, dtype, pad):
    gen = torch.Generator().manual_seed(num_tokens)
    num_pages = 2 * ((num_tokens + page_size - 1) // page_size) + 1
    cache = torch.full((num_pages, page_size, heads, head_dim), float("nan"), dtype=dtype)
    slots = torch.randperm(num_pages * page_size, generator=gen)[:num_tokens]  # shuffled
    if pad:
        slots[::3] = -1
    key = torch.randn(num_tokens, heads, head_dim, generator=gen)  # float32: cast on store
    value = torch.randn(num_tokens, heads, head_dim, generator=gen)
    return key, value, cache, cache.clone(), slots


@pytest.mark.parametrize("pad", [False, True], ids=["dense", "padded"])
@pytest.mark.parametrize("num_tokens, page_size, heads, head_dim, dtype", [
    (1, 1, 2, 64, torch.float32), (17, 16, 4, 64, torch.float32),
    (1025, 16, 3, 64, torch.float32), (70, 5, 2, 128, torch.bfloat16)])
def test_writes_exactly_what_the_reference_writes(num_tokens, page_size, heads, head_dim,
                                                  dtype, pad):
    key, value, k_cache, v_cache, slots = _case(num_tokens, page_size, heads, head_dim, dtype,
                                                pad)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_index_copy(key, value, k_cache, v_cache, slots)
    store_kv_reference(key, value, k_ref, v_ref, slots)
    torch.testing.assert_close(k_cache, k_ref, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_ref, rtol=0, atol=0, equal_nan=True)
    written = int((slots >= 0).sum()) * heads * head_dim
    assert int((~k_cache.isnan()).sum()) == written  # no slot beyond the mapping's


def test_empty_batch_changes_nothing():
    key, value, k_cache, v_cache, _ = _case(1, 4, 2, 8, torch.float32, False)
    store_kv_index_copy(key[:0], value[:0], k_cache, v_cache, torch.empty(0, dtype=torch.int64))
    assert k_cache.isnan().all() and v_cache.isnan().all()
