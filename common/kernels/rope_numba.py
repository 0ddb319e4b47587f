"""Rotary position embedding on the CPU as one compiled loop (numba): each head's row of q and
k rotated in float32 and rounded back once, in place, with no temporaries beyond one row.

Same signature and semantics as :func:`common.kernels.rope.rope_reference`, bit for bit: the
same float32 products and differences per element (x1 * cos - x2 * sin, x2 * cos + x1 * sin,
no fused multiply-add), rounded once to q's dtype (tests/kernels/test_numba_kernels.py). q and k
may be strided views (D contiguous); only their own elements are written. float32 and bfloat16 only
(`supports`).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from common.kernels.numba_rows import address, f32_at, i64_at, kernel, narrow_row, u16_at, widen_row


@numba.njit(inline="always")
def _rotate_f32(row, cos, sin, half):
    for i in range(half):
        x1 = row[i]
        x2 = row[i + half]
        row[i] = x1 * cos[i] - x2 * sin[i]
        row[i + half] = x2 * cos[i] + x1 * sin[i]


@kernel()
def _rope_bf16(q_at, k_at, positions_at, cos_sin_at, num_tokens, q_strides, k_strides,
               num_positions, head_dim):
    # q: [T, Hq, D], k: [T, Hkv, D] bfloat16 bits, strides (token, head, 1) in elements, the
    # extents given as (T, token stride); positions: [T] int64; cos_sin: [P, D] float32
    half = head_dim // 2
    positions = i64_at(positions_at, (num_tokens,))
    cos_sin = f32_at(cos_sin_at, (num_positions, head_dim))
    for t in range(num_tokens):
        if positions[t] < 0 or positions[t] >= num_positions:
            return False  # nothing written
    row = np.empty(head_dim, np.uint32)
    row_f = row.view(np.float32)
    for x_at, (heads, token_stride, head_stride) in ((q_at, q_strides), (k_at, k_strides)):
        x = u16_at(x_at, ((num_tokens - 1) * token_stride + (heads - 1) * head_stride
                          + head_dim,))
        for t in range(num_tokens):
            cos = cos_sin[positions[t], :half]
            sin = cos_sin[positions[t], half:]
            for h in range(heads):
                at = t * token_stride + h * head_stride
                widen_row(x[at:at + head_dim], row)
                _rotate_f32(row_f, cos, sin, half)
                narrow_row(row, x[at:at + head_dim])
    return True


@kernel()
def _rope_f32(q_at, k_at, positions_at, cos_sin_at, num_tokens, q_strides, k_strides,
              num_positions, head_dim):
    # as _rope_bf16, q and k float32
    half = head_dim // 2
    positions = i64_at(positions_at, (num_tokens,))
    cos_sin = f32_at(cos_sin_at, (num_positions, head_dim))
    for t in range(num_tokens):
        if positions[t] < 0 or positions[t] >= num_positions:
            return False  # nothing written
    for x_at, (heads, token_stride, head_stride) in ((q_at, q_strides), (k_at, k_strides)):
        x = f32_at(x_at, ((num_tokens - 1) * token_stride + (heads - 1) * head_stride
                          + head_dim,))
        for t in range(num_tokens):
            cos = cos_sin[positions[t], :half]
            sin = cos_sin[positions[t], half:]
            for h in range(heads):
                at = t * token_stride + h * head_stride
                _rotate_f32(x[at:at + head_dim], cos, sin, half)
    return True


def supports(q: torch.Tensor, k: torch.Tensor) -> bool:
    return (q.is_cpu and q.dtype is k.dtype
            and (q.dtype is torch.float32 or q.dtype is torch.bfloat16))


def _layout(x: torch.Tensor) -> tuple[int, int, int]:
    """[T, H, D] with unit stride along D -> (H, token stride, head stride) in elements."""
    assert x.stride(2) == 1, ("rope_numba: head_dim must be contiguous", x.stride())
    return x.shape[1], x.stride(0), x.stride(1)


def rope_numba(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_sin: torch.Tensor) -> None:
    """q: [T, Hq, D], k: [T, Hkv, D] (one dtype, `supports`; any strides with D contiguous),
    positions: [T] int64, cos_sin: [P, D] float32 (cos | sin); in place."""
    assert supports(q, k), (q.dtype, k.dtype, q.device)
    num_tokens, _, head_dim = q.shape
    assert k.dim() == 3 and k.shape[0] == num_tokens and k.shape[2] == head_dim, (q.shape,
                                                                                  k.shape)
    assert positions.shape == (num_tokens,) and cos_sin.shape[1] == head_dim, (
        positions.shape, cos_sin.shape)
    assert cos_sin.dtype is torch.float32 and head_dim % 2 == 0 and cos_sin.is_contiguous()
    assert positions.dtype is torch.int64
    if num_tokens == 0:
        return
    positions = positions.contiguous()
    kernel_fn = _rope_bf16 if q.dtype is torch.bfloat16 else _rope_f32
    if not kernel_fn(address(q), address(k), address(positions), address(cos_sin), num_tokens,
                     _layout(q), _layout(k), cos_sin.shape[0], head_dim):
        raise IndexError(f"rope_numba: a position outside the cos/sin table's "
                         f"{cos_sin.shape[0]} rows")
