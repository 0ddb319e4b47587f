"""Storing new tokens' K/V into their page slots on the CPU: one ``index_copy_`` per cache
instead of the reference's mask, masked copies and advanced-index assignment.

Same signature and semantics as :func:`common.kernels.store_kv.store_kv_reference`; a batch
with padding tokens (slot -1, to be skipped) takes the reference, so no slot outside
``slot_mapping``'s non-negative entries is ever written. Few torch ops a call (a decode step
pays a few microseconds for each): one min for the padding check, no cast when dtypes match.
"""

from __future__ import annotations

import torch

from common.kernels.store_kv import store_kv_reference


def store_kv_index_copy(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key, value: [T, Hkv, D]; caches: [P, S, Hkv, D]; slot_mapping: [T] int64, -1 = skip."""
    assert key.shape == value.shape and key.shape[0] == slot_mapping.shape[0], (
        key.shape, value.shape, slot_mapping.shape)
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == key.shape[1:], (
        k_cache.shape, key.shape)
    if slot_mapping.numel() == 0:
        return
    if int(slot_mapping.min()) < 0:  # padding to skip: the reference's masked path
        store_kv_reference(key, value, k_cache, v_cache, slot_mapping)
        return
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    for src, cache in ((key, k_cache), (value, v_cache)):  # a cast only where dtypes differ
        cache.view(num_slots, *cache.shape[2:]).index_copy_(
            0, slot_mapping, src if src.dtype == cache.dtype else src.to(cache.dtype))
