"""Rotary position embedding on the CPU as one compiled loop (numba): each head's row of q and
k rotated in float32 and rounded back once, in place, with no temporaries beyond one row.

Same signature and semantics as :func:`common.kernels.rope.rope_reference`, bit for bit: the
same float32 products and differences per element (x1 * cos - x2 * sin, x2 * cos + x1 * sin,
no fused multiply-add), rounded once to q's dtype (tests/kernels/test_numba_kernels.py). q and k
may be strided views; only their own elements are written. float32 and bfloat16 only
(`supports`).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from common.kernels.numba_rows import bits_view, kernel, narrow_row, widen_row


@numba.njit(inline="always")
def _rotate_f32(row, cos, sin, half):
    for i in range(half):
        x1 = row[i]
        x2 = row[i + half]
        row[i] = x1 * cos[i] - x2 * sin[i]
        row[i + half] = x2 * cos[i] + x1 * sin[i]


@kernel()
def _rope_bf16(q, k, positions, cos_sin):
    # q: [T, Hq, D], k: [T, Hkv, D] uint16 (bfloat16 bits); positions: [T]; cos_sin: [P, D]
    num_tokens, head_dim = q.shape[0], q.shape[2]
    half = head_dim // 2
    row = np.empty(head_dim, np.uint32)
    row_f = row.view(np.float32)
    for t in range(num_tokens):
        cos = cos_sin[positions[t], :half]
        sin = cos_sin[positions[t], half:]
        for x in (q, k):
            for h in range(x.shape[1]):
                widen_row(x[t, h], row)
                _rotate_f32(row_f, cos, sin, half)
                narrow_row(row, x[t, h])


@kernel()
def _rope_f32(q, k, positions, cos_sin):
    # q: [T, Hq, D], k: [T, Hkv, D] float32; positions: [T]; cos_sin: [P, D]
    num_tokens, head_dim = q.shape[0], q.shape[2]
    half = head_dim // 2
    for t in range(num_tokens):
        cos = cos_sin[positions[t], :half]
        sin = cos_sin[positions[t], half:]
        for x in (q, k):
            for h in range(x.shape[1]):
                _rotate_f32(x[t, h], cos, sin, half)


def supports(q: torch.Tensor, k: torch.Tensor) -> bool:
    return (q.device.type == "cpu" and q.dtype == k.dtype
            and q.dtype in (torch.float32, torch.bfloat16))


def rope_numba(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_sin: torch.Tensor) -> None:
    """q: [T, Hq, D], k: [T, Hkv, D] (one dtype, `supports`), positions: [T] int64, cos_sin:
    [P, D] float32 (cos | sin); in place."""
    assert supports(q, k), (q.dtype, k.dtype, q.device)
    num_tokens, _, head_dim = q.shape
    assert k.dim() == 3 and k.shape[0] == num_tokens and k.shape[2] == head_dim, (q.shape,
                                                                                  k.shape)
    assert positions.shape == (num_tokens,) and cos_sin.shape[1] == head_dim, (
        positions.shape, cos_sin.shape)
    assert cos_sin.dtype == torch.float32 and head_dim % 2 == 0
    kernel = _rope_bf16 if q.dtype == torch.bfloat16 else _rope_f32
    kernel(bits_view(q), bits_view(k), positions.numpy(), cos_sin.numpy())
