"""Rotary position embedding on the CPU with q and k rotated as one tensor: one cast, one set of
multiplies and one join for both, instead of the reference's per tensor.

Same signature and semantics as :func:`common.kernels.rope.rope_reference`, bit for bit: the
same float32 products and sums per element (x1 * cos - x2 * sin, x2 * cos + x1 * sin), rounded
once to q's dtype on the copy back. q and k may be strided views (e.g. of a fused qkv row); only
their own elements are written. In a decode step every torch op costs a few microseconds more
than in isolation (the linears' weights evict the dispatcher's working set), so the op count is
what this saves: ~20 ops a call against ~33. Past ``JOINT_MAX_TOKENS`` tokens (prefill) the
extra copy of the join costs more than the ops it saves, and the reference runs.
"""

from __future__ import annotations

import torch

from common.kernels.rope import rope_reference

# one thread, bench checkpoint's shapes, reference / joint: 1.33-1.41x at 8 tokens, 1.11-1.29x
# at 64, 0.78-1.11x at 128, 0.32-0.96x at 256-512
JOINT_MAX_TOKENS = 64


def rope_joint(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_sin: torch.Tensor) -> None:
    """q: [T, Hq, D], k: [T, Hkv, D] (same dtype), positions: [T] int64, cos_sin: [P, D]
    float32 (cos | sin); in place."""
    num_tokens, num_q_heads, head_dim = q.shape
    assert k.dim() == 3 and k.shape[0] == num_tokens and k.shape[2] == head_dim, (q.shape,
                                                                                  k.shape)
    assert positions.shape == (num_tokens,) and cos_sin.shape[1] == head_dim, (
        positions.shape, cos_sin.shape)
    if q.dtype != k.dtype or num_tokens > JOINT_MAX_TOKENS:  # one dtype to join; prefill
        rope_reference(q, k, positions, cos_sin)
        return
    half = head_dim // 2
    table = cos_sin[positions]  # [T, D]
    cos, sin = table[:, None, :half], table[:, None, half:]  # [T, 1, D/2]
    qk = torch.cat([q, k], dim=1).float()  # [T, Hq + Hkv, D], a new tensor in any dtype
    x1, x2 = qk[..., :half], qk[..., half:]
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)  # [T, Hq + Hkv, D]
    q.copy_(rotated[:, :num_q_heads])
    k.copy_(rotated[:, num_q_heads:])
