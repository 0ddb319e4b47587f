"""Chunked-prefill attention over paged KV on the CPU: per chunk of the batch, one gather of its
sequence's pages and torch's fused scaled_dot_product_attention with the chunk's causal mask.

Same signature and semantics as :func:`common.kernels.paged_prefill_attention.
paged_prefill_attention_reference`: query ``i`` of sequence ``b`` attends to keys
``[0, context_lens[b] + i]``; only the pages holding ``context_lens[b] + chunk_len`` tokens are
gathered (whole pages, as the reference does) and the copy is cut to that many tokens before
any arithmetic, so no slot at or past it reaches the output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_prefill_attention_sdpa(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
) -> torch.Tensor:
    """q: [T, Hq, D]; caches: [P, S, Hkv, D]; page_table: [B, max_pages] int32; cu_seqlens_q:
    [B + 1] int32; context_lens: [B] int32 -> [T, Hq, D]."""
    del max_seqlen_q
    page_size, num_kv_heads, head_dim = k_cache.shape[1:]
    assert v_cache.shape == k_cache.shape and q.shape[2] == head_dim, (q.shape, k_cache.shape)
    assert q.shape[1] % num_kv_heads == 0, (q.shape, k_cache.shape)
    out = torch.empty_like(q)
    bounds = cu_seqlens_q.tolist()
    for b, (start, end, ctx) in enumerate(zip(bounds[:-1], bounds[1:], context_lens.tolist())):
        n = end - start
        if n == 0:
            continue
        total = ctx + n
        pages = page_table[b, : (total + page_size - 1) // page_size].long()
        ks = k_cache.index_select(0, pages).flatten(0, 1)[:total]  # [total, Hkv, D]
        vs = v_cache.index_select(0, pages).flatten(0, 1)[:total]
        qs = q[start:end].transpose(0, 1)[None]  # [1, Hq, n, D]
        if ctx == 0:  # the chunk starts its prompt: plain causal
            mask, causal = None, True
        else:
            rows = ctx + torch.arange(n, device=q.device)[:, None]  # absolute positions
            mask, causal = torch.arange(total, device=q.device)[None, :] <= rows, False
        o = F.scaled_dot_product_attention(
            qs, ks.transpose(0, 1)[None], vs.transpose(0, 1)[None], attn_mask=mask,
            is_causal=causal, scale=scale, enable_gqa=True)  # [1, Hq, n, D]
        out[start:end] = o[0].transpose(0, 1)
    return out
