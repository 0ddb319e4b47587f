"""Writing new tokens' K/V into their page slots vs the torch reference."""

from __future__ import annotations

import pytest
import torch

from common.kernels.store_kv import store_kv, store_kv_reference

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# (num_tokens, page_size, num_kv_heads, head_dim, dtype)
CASES = [
    pytest.param(1, 1, 2, 64, F32, id="t1-ps1-h2-d64-f32"),
    pytest.param(17, 16, 8, 128, F16, id="t17-ps16-h8-d128-f16"),
    pytest.param(70, 5, 2, 128, F32, id="t70-ps5-h2-d128-f32"),
    pytest.param(70, 1, 8, 64, F16, id="t70-ps1-h8-d64-f16"),
    pytest.param(70, 16, 3, 64, F32, id="t70-ps16-h3-d64-f32"),  # Hkv*D not a power of two
    pytest.param(70, 16, 8, 128, BF16, id="t70-ps16-h8-d128-bf16", marks=pytest.mark.gpu),
]


def _pool(num_tokens, page_size, heads, head_dim, dtype, device):
    """A NaN pool with twice the slots needed, and a shuffled slot per token (some -1)."""
    gen = torch.Generator().manual_seed(0)
    num_pages = 2 * ((num_tokens + page_size - 1) // page_size) + 1
    k_cache = torch.full((num_pages, page_size, heads, head_dim), float("nan"), dtype=dtype)
    slots = torch.randperm(num_pages * page_size, generator=gen)[:num_tokens]
    key = torch.randn(num_tokens, heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, heads, head_dim, generator=gen).to(dtype)
    return [t.to(device) for t in (key, value, k_cache, k_cache.clone(), slots)]


@pytest.mark.parametrize(("num_tokens", "page_size", "heads", "head_dim", "dtype"), CASES)
def test_matches_reference(device, num_tokens, page_size, heads, head_dim, dtype):
    tensors = _pool(num_tokens, page_size, heads, head_dim, dtype, device)
    key, value, k_cache, v_cache, slots = tensors
    slots[::3] = -1  # padding tokens: skipped
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv(key, value, k_cache, v_cache, slots)
    store_kv_reference(key, value, k_ref, v_ref, slots)
    torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=0, equal_nan=True)
    kept = slots >= 0
    assert (~k_cache.isnan()).sum() == kept.sum() * heads * head_dim  # wrote exactly those


def test_all_skipped_leaves_cache_untouched(device):
    key, value, k_cache, v_cache, slots = _pool(17, 5, 2, 64, F16, device)
    k_cache.view(-1)[::7] = 1.5  # some finite content that must survive
    before_k, before_v = k_cache.clone(), v_cache.clone()
    store_kv(key, value, k_cache, v_cache, torch.full_like(slots, -1))
    torch.testing.assert_close(k_cache, before_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, before_v, atol=0, rtol=0, equal_nan=True)


def test_strided_key_value(device):
    """key and value as views of a fused qkv projection."""
    _, _, k_cache, v_cache, slots = _pool(17, 16, 2, 64, F32, device)
    qkv = torch.randn(17, 8 + 2 * 2, 64, device=device)
    _, key, value = qkv.split([8, 2, 2], dim=1)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv(key, value, k_cache, v_cache, slots)
    store_kv_reference(key, value, k_ref, v_ref, slots)
    torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=0, equal_nan=True)
