"""Causal prefill attention on the CPU: torch's fused scaled_dot_product_attention per prompt of
the ragged batch (each is one large call, so the loop over prompts costs nothing measurable).

Same signature and semantics as
:func:`common.kernels.prefill_attention.prefill_attention_reference`; grouped-query heads use
SDPA's ``enable_gqa`` (no K/V copy per group).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def prefill_attention_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D]; cu_seqlens: [B + 1] int32 -> [T, Hq, D]."""
    del max_seqlen
    num_tokens, num_q_heads, head_dim = q.shape
    assert k.shape == v.shape and k.shape[0] == num_tokens and k.shape[2] == head_dim, (
        q.shape, k.shape, v.shape)
    assert num_q_heads % k.shape[1] == 0, (q.shape, k.shape)
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        qs = q[start:end].transpose(0, 1)[None]  # [1, Hq, n, D]
        ks = k[start:end].transpose(0, 1)[None]  # [1, Hkv, n, D]
        vs = v[start:end].transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                           enable_gqa=True)  # [1, Hq, n, D]
        out[start:end] = o[0].transpose(0, 1)
    return out
