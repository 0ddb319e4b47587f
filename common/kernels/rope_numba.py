"""Rotary position embedding on the CPU as one compiled loop (numba, common/kernels/numba_cpu.py):
each head's row of q and k rotated in float32 and rounded back once, in place, with no
temporaries beyond one row.

Same signature and semantics as :func:`common.kernels.rope.rope_reference`, bit for bit: the
same float32 products and differences per element (x1 * cos - x2 * sin, x2 * cos + x1 * sin,
no fused multiply-add), rounded once to q's dtype (tests/kernels/test_numba_kernels.py). q and k
may be strided views whose rows do not overlap (D contiguous, heads and tokens apart: a view of
a fused qkv row, say); only their own elements are written. float32 and bfloat16 only
(`supports`); anything else takes the torch kernels.
"""

from __future__ import annotations

import torch

from common.kernels.numba_cpu import address, rope_bf16, rope_f32


def _layout(x: torch.Tensor) -> tuple[int, int, int] | None:
    """[T, H, D] -> (H, token stride, head stride) in elements when D is contiguous, each
    token's heads lie apart and each token's rows end before the next token's begin (so no two
    (token, head) rows overlap); else None."""
    tokens, heads, dim = x.shape
    token_stride, head_stride = x.stride(0), x.stride(1)
    if dim > 1 and x.stride(2) != 1:
        return None
    if heads > 1 and head_stride < dim:
        return None
    if tokens > 1 and token_stride < (heads - 1) * head_stride + dim:
        return None
    return heads, token_stride, head_stride


def _layouts(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
             cos_sin: torch.Tensor) -> tuple[tuple[int, int, int], tuple[int, int, int]] | None:
    """q's and k's `_layout` when rope_numba takes these arguments (see `supports`), else
    None."""
    if not (q.dtype in (torch.float32, torch.bfloat16) and k.dtype is q.dtype
            and q.is_cpu and k.is_cpu and positions.is_cpu and cos_sin.is_cpu
            and q.dim() == 3 and k.dim() == 3 and positions.dtype is torch.int64
            and cos_sin.dtype is torch.float32 and cos_sin.is_contiguous()):
        return None
    q_layout, k_layout = _layout(q), _layout(k)
    return None if q_layout is None or k_layout is None else (q_layout, k_layout)


def supports(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
             cos_sin: torch.Tensor) -> bool:
    """Whether rope_numba takes these: CPU tensors, q and k of one dtype (float32 or bfloat16),
    rows that do not overlap, int64 positions and a contiguous float32 table."""
    return _layouts(q, k, positions, cos_sin) is not None


def rope_numba(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_sin: torch.Tensor) -> None:
    """q: [T, Hq, D], k: [T, Hkv, D], positions: [T] int64, cos_sin: [P, D] float32 (cos | sin),
    as `supports` says; in place. Raises ValueError for other arguments and IndexError (nothing
    written) for a position outside the table: the loop reads raw memory."""
    layouts = _layouts(q, k, positions, cos_sin)
    if layouts is None:
        raise ValueError("rope_numba: CPU q, k of one dtype (float32/bfloat16) with rows that "
                         "do not overlap, int64 positions, a contiguous float32 table")
    num_tokens, _, head_dim = q.shape
    if (k.shape[0] != num_tokens or k.shape[2] != head_dim or positions.shape != (num_tokens,)
            or cos_sin.dim() != 2 or cos_sin.shape[1] != head_dim or head_dim % 2):
        raise ValueError(f"rope_numba: q {tuple(q.shape)}, k {tuple(k.shape)}, positions "
                         f"{tuple(positions.shape)}, table {tuple(cos_sin.shape)} do not agree")
    if num_tokens == 0:
        return
    positions = positions.contiguous()
    loop = rope_bf16 if q.dtype is torch.bfloat16 else rope_f32
    if not loop(address(q), address(k), address(positions), address(cos_sin), num_tokens,
                *layouts, cos_sin.shape[0], head_dim):
        raise IndexError(f"rope_numba: a position outside the cos/sin table's "
                         f"{cos_sin.shape[0]} rows")
