"""Write the K and V of new tokens into their page slots."""

from __future__ import annotations

import functools

import torch


def store_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key, value: [T, Hkv, D]; caches: [P, S, Hkv, D]; slot_mapping: [T] int64, -1 = skip."""
    num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_flat = k_cache.view(num_pages * page_size, *k_cache.shape[2:])
    v_flat = v_cache.view(num_pages * page_size, *v_cache.shape[2:])
    k_flat[slots] = key[keep].to(k_cache.dtype)
    v_flat[slots] = value[keep].to(v_cache.dtype)


# --------------------------------------------------------------------------------------------
# Triton kernel. Triton is optional (the reference above works without it), and the kernel is
# jitted on first use so that TRITON_INTERPRET is read then, not when this module is imported.
# --------------------------------------------------------------------------------------------
try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without Triton keep the reference
    triton = tl = None


def _store_kv_kernel(
    key_ptr,  # [T, Hkv, D]
    value_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [P, S, Hkv, D]
    v_cache_ptr,  # [P, S, Hkv, D]
    slot_ptr,  # [T] int64, -1 = skip
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kc_page,
    stride_kc_off,
    stride_kc_head,
    stride_vc_page,
    stride_vc_off,
    stride_vc_head,
    num_tokens,
    page_size,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_HD: tl.constexpr,
):
    # One program writes BLOCK_T tokens, all heads: a [BLOCK_T, BLOCK_HD] tile of (head, dim).
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    offs_hd = tl.arange(0, BLOCK_HD)  # [BLOCK_HD]
    head = offs_hd // HEAD_DIM
    dim = offs_hd % HEAD_DIM
    slot = tl.load(slot_ptr + offs_t, mask=offs_t < num_tokens, other=-1)  # [BLOCK_T] int64
    keep = slot >= 0
    page = tl.where(keep, slot // page_size, 0)
    off = tl.where(keep, slot % page_size, 0)
    mask = keep[:, None] & (offs_hd < NUM_HEADS * HEAD_DIM)[None, :]
    t64 = offs_t.to(tl.int64)[:, None]
    k = tl.load(key_ptr + t64 * stride_kt + head[None, :] * stride_kh + dim[None, :], mask=mask)
    v = tl.load(value_ptr + t64 * stride_vt + head[None, :] * stride_vh + dim[None, :], mask=mask)
    kc = k_cache_ptr + page[:, None] * stride_kc_page + off[:, None] * stride_kc_off
    vc = v_cache_ptr + page[:, None] * stride_vc_page + off[:, None] * stride_vc_off
    kc = kc + head[None, :] * stride_kc_head + dim[None, :]
    vc = vc + head[None, :] * stride_vc_head + dim[None, :]
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _jit(fn):
    return triton.jit(fn)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton version of :func:`store_kv_reference` (same arguments, same effect)."""
    num_tokens, num_heads, head_dim = key.shape
    assert value.shape == key.shape, (value.shape, key.shape)
    assert k_cache.dim() == 4 and v_cache.shape == k_cache.shape
    assert k_cache.shape[2:] == (num_heads, head_dim), (k_cache.shape, key.shape)
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64
    assert key.dtype == value.dtype and k_cache.dtype == v_cache.dtype
    assert key.stride(-1) == 1 and value.stride(-1) == 1, "head_dim must be contiguous"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert slot_mapping.is_contiguous()
    assert key.is_cuda or triton.knobs.runtime.interpret, "CPU tensors need TRITON_INTERPRET=1"
    if num_tokens == 0:
        return
    block_hd = triton.next_power_of_2(num_heads * head_dim)
    block_t = max(1, min(16, 4096 // block_hd))
    grid = (triton.cdiv(num_tokens, block_t),)
    _jit(_store_kv_kernel)[grid](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        num_tokens,
        k_cache.shape[1],
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_T=block_t,
        BLOCK_HD=block_hd,
        num_warps=4,
    )
