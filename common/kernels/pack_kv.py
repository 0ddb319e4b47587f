"""Gather a request's K/V of one layer into a transfer buffer, and scatter one back."""

from __future__ import annotations

import functools

import numpy as np
import torch


def _token_slots(page_table: torch.Tensor, page_size: int, token_start: int,
                 num_tokens: int) -> torch.Tensor:
    tokens = torch.arange(token_start, token_start + num_tokens, device=page_table.device)
    return page_table.long()[tokens // page_size] * page_size + tokens % page_size  # [n]


def pack_kv_reference(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    token_start: int,
    num_tokens: int,
) -> torch.Tensor:
    """caches: [P, S, Hkv, D]; page_table: [num_pages] int32 -> [2, num_tokens, Hkv, D]."""
    num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
    slots = _token_slots(page_table, page_size, token_start, num_tokens)
    k_flat = k_cache.view(num_pages * page_size, *k_cache.shape[2:])
    v_flat = v_cache.view(num_pages * page_size, *v_cache.shape[2:])
    return torch.stack([k_flat[slots], v_flat[slots]])


def unpack_kv_reference(
    buffer: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    token_start: int,
) -> None:
    """buffer: [2, n, Hkv, D] written to tokens [token_start, token_start + n) of the request."""
    num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
    slots = _token_slots(page_table, page_size, token_start, buffer.shape[1])
    k_cache.view(num_pages * page_size, *k_cache.shape[2:])[slots] = buffer[0]
    v_cache.view(num_pages * page_size, *v_cache.shape[2:])[slots] = buffer[1]


# --------------------------------------------------------------------------------------------
# CPU copies for the handoff: one copy each way, straight between the pages and a transfer
# buffer (torch's advanced indexing costs a gather plus a stack on the way out, and index_put on
# bf16 is 5x slower than numpy's row copy on the way in). Same results as the references above
# (tests/kernels/test_pack_kv_cpu.py); for caches in CPU memory only.
# --------------------------------------------------------------------------------------------
def pack_kv_cpu(k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                token_start: int, out: torch.Tensor) -> torch.Tensor:
    """caches: [P, S, Hkv, D] on the CPU; out: [2, n, Hkv, D] contiguous, same dtype, filled
    with tokens [token_start, token_start + n) of the request and returned."""
    num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
    num_tokens = out.shape[1]
    assert out.is_contiguous() and out.dtype == k_cache.dtype, (out.dtype, k_cache.dtype)
    assert out.shape[2:] == k_cache.shape[2:], (out.shape, k_cache.shape)
    slots = _token_slots(page_table, page_size, token_start, num_tokens)  # [n]
    row = k_cache.shape[2] * k_cache.shape[3]
    for half, cache in ((0, k_cache), (1, v_cache)):
        torch.index_select(cache.view(num_pages * page_size, row), 0, slots,
                           out=out[half].view(num_tokens, row))
    return out


def unpack_kv_bytes_cpu(k: np.ndarray, v: np.ndarray, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, page_table: np.ndarray, token_start: int,
                        num_tokens: int) -> None:
    """k, v: uint8 arrays of num_tokens x Hkv x D elements each (the wire's little-endian
    bytes, read only); caches: [P, S, Hkv, D] contiguous on the CPU; page_table: [num_pages]
    integers. Writes tokens [token_start, token_start + num_tokens) of the request."""
    num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
    row = k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()  # bytes per token
    assert k.size == v.size == num_tokens * row, (k.size, v.size, num_tokens, row)
    assert token_start + num_tokens <= len(page_table) * page_size, "page table too short"
    tokens = np.arange(token_start, token_start + num_tokens)
    slots = np.asarray(page_table, dtype=np.int64)[tokens // page_size] * page_size + (
        tokens % page_size)  # [n]
    for data, cache in ((k, k_cache), (v, v_cache)):
        assert cache.is_contiguous() and cache.device.type == "cpu"
        pages = cache.view(torch.uint8).numpy().reshape(num_pages * page_size, row)
        pages[slots] = data.reshape(num_tokens, row)


# --------------------------------------------------------------------------------------------
# Triton kernels, jitted on first use (TRITON_INTERPRET is read then, not at import).
# --------------------------------------------------------------------------------------------
try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without Triton keep the reference
    triton = tl = None

# GPU launch config: elements per K (and per V) tile of one program, and its warps.
_TILE_ELEMS, _NUM_WARPS = 4096, 8


def _pack_kv_kernel(
    k_cache_ptr,  # [P, S, Hkv, D]
    v_cache_ptr,  # [P, S, Hkv, D]
    page_table_ptr,  # [num_pages] int32
    buffer_ptr,  # [2, n, Hkv, D] contiguous
    stride_kc_page,
    stride_kc_off,
    stride_vc_page,
    stride_vc_off,
    token_start,
    num_tokens,
    page_size,
    ROW: tl.constexpr,  # Hkv * D: a token's elements, contiguous in cache and buffer
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    UNPACK: tl.constexpr,  # False: pages -> buffer; True: buffer -> pages
):
    # Program (i, j) moves tokens [i*BLOCK_T, (i+1)*BLOCK_T) x columns [j*BLOCK_C, ...) of both
    # K and V. Only page_table entries of real tokens are read.
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T] request-relative
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C]
    mask_t = offs_t < num_tokens
    mask = mask_t[:, None] & (offs_c < ROW)[None, :]
    tok = token_start + offs_t
    page = tl.load(page_table_ptr + tok // page_size, mask=mask_t, other=0).to(tl.int64)
    off = tok % page_size
    k_ptrs = k_cache_ptr + (page * stride_kc_page + off * stride_kc_off)[:, None] + offs_c[None, :]
    v_ptrs = v_cache_ptr + (page * stride_vc_page + off * stride_vc_off)[:, None] + offs_c[None, :]
    buf_ptrs = buffer_ptr + offs_t.to(tl.int64)[:, None] * ROW + offs_c[None, :]  # K half
    v_buf_ptrs = buffer_ptr + (offs_t + num_tokens).to(tl.int64)[:, None] * ROW + offs_c[None, :]
    if UNPACK:
        k = tl.load(buf_ptrs, mask=mask)
        v = tl.load(v_buf_ptrs, mask=mask)
        tl.store(k_ptrs, k, mask=mask)
        tl.store(v_ptrs, v, mask=mask)
    else:
        k = tl.load(k_ptrs, mask=mask)
        v = tl.load(v_ptrs, mask=mask)
        tl.store(buf_ptrs, k, mask=mask)
        tl.store(v_buf_ptrs, v, mask=mask)


@functools.cache
def _jit(fn):
    return triton.jit(fn)


def _launch(k_cache, v_cache, page_table, buffer, token_start, num_tokens, unpack) -> None:
    assert k_cache.dim() == 4 and v_cache.shape == k_cache.shape, (k_cache.shape, v_cache.shape)
    assert k_cache.dtype == v_cache.dtype == buffer.dtype, (k_cache.dtype, buffer.dtype)
    assert page_table.dim() == 1 and page_table.dtype == torch.int32
    assert page_table.is_contiguous()
    page_size, num_heads, head_dim = k_cache.shape[1:]
    assert buffer.shape == (2, num_tokens, num_heads, head_dim), (buffer.shape, k_cache.shape)
    assert buffer.is_contiguous()
    for cache in (k_cache, v_cache):  # each token's [Hkv, D] row must be contiguous
        assert cache.stride(3) == 1 and cache.stride(2) == head_dim, cache.stride()
    assert token_start >= 0
    assert k_cache.is_cuda or triton.knobs.runtime.interpret, "CPU tensors need TRITON_INTERPRET=1"
    assert token_start + num_tokens <= page_table.numel() * page_size, "page table too short"
    if num_tokens == 0:
        return
    row = num_heads * head_dim
    block_c = min(triton.next_power_of_2(row), 1024)
    block_t = max(1, _TILE_ELEMS // block_c)  # tokens per program
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(row, block_c))
    _jit(_pack_kv_kernel)[grid](
        k_cache,
        v_cache,
        page_table,
        buffer,
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        token_start,
        num_tokens,
        page_size,
        ROW=row,
        BLOCK_T=block_t,
        BLOCK_C=block_c,
        UNPACK=unpack,
        num_warps=_NUM_WARPS,
    )


def pack_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    token_start: int,
    num_tokens: int,
) -> torch.Tensor:
    """Triton version of :func:`pack_kv_reference` -> [2, num_tokens, Hkv, D]."""
    buffer = k_cache.new_empty((2, num_tokens, *k_cache.shape[2:]))  # [2, n, Hkv, D]
    _launch(k_cache, v_cache, page_table, buffer, token_start, num_tokens, unpack=False)
    return buffer


def unpack_kv(
    buffer: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    token_start: int,
) -> None:
    """Triton version of :func:`unpack_kv_reference` (in place on the caches)."""
    _launch(k_cache, v_cache, page_table, buffer, token_start, buffer.shape[1], unpack=True)
