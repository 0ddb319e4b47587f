"""Paged decode attention on the CPU: torch's fused scaled_dot_product_attention per sequence,
over a view of its pages where they form one run in the pool (the allocator hands pages out in
ascending runs, so they mostly do) and over a gather of its own pages where they do not.

Same signature and semantics as :func:`common.kernels.decode_attention.decode_attention_reference`.
Measured on a 2-core AVX2 host (bench/step_profile.py), a view per sequence beats one batched
gather of every sequence's pages plus one masked SDPA call by 2.5-4x at batch 1-32 and 1088
tokens: the gather's copy costs more than the attention reads. Each sequence reads exactly its
first seq_lens[b] slots (a view, or a slice of the gather cut to that length before any
arithmetic); page-table entries past its pages are never dereferenced. Grouped-query heads are
folded into the query axis ([Hkv, G, D]): no K/V copy per group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def is_run(row: list[int], num_pages: int) -> bool:
    """Whether the first num_pages entries of a page-table row are p, p + 1, ... ."""
    return row[:num_pages] == list(range(row[0], row[0] + num_pages))


def contiguous_rows(page_table: torch.Tensor, num_pages: torch.Tensor) -> list[bool]:
    """page_table: [B, W] int32; num_pages: [B] pages in use -> per row, whether its first
    num_pages[b] entries are one ascending run (p, p + 1, ...)."""
    return [is_run(row, n) for row, n in zip(page_table.tolist(), num_pages.tolist(),
                                             strict=True)]


def decode_attention_sdpa(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q: [B, Hq, D]; caches: [P, S, Hkv, D]; page_table: [B, max_pages] int32;
    seq_lens: [B] int32 (>= 1) -> [B, Hq, D]."""
    batch, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1:3]
    assert v_cache.shape == k_cache.shape and k_cache.shape[3] == head_dim, (q.shape,
                                                                             k_cache.shape)
    assert num_q_heads % num_kv_heads == 0, (num_q_heads, num_kv_heads)
    assert page_table.dim() == 2 and page_table.shape[0] == batch, (page_table.shape, batch)
    assert seq_lens.shape == (batch,), (seq_lens.shape, batch)
    assert q.dtype == k_cache.dtype == v_cache.dtype, (q.dtype, k_cache.dtype, v_cache.dtype)
    out = torch.empty_like(q)
    if batch == 0:
        return out
    group = num_q_heads // num_kv_heads
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)  # [P * S, Hkv, D]
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    queries = q.reshape(batch, num_kv_heads, group, head_dim)  # [B, Hkv, G, D]
    # one host copy of the table and the lengths per call: no tensor op per row for the plan
    for b, (n, row) in enumerate(zip(seq_lens.tolist(), page_table.tolist(), strict=True)):
        pages = (n + page_size - 1) // page_size
        assert 1 <= n and pages <= len(row), (n, page_table.shape)
        if is_run(row, pages):  # one ascending run of pages: read through a view
            first = row[0] * page_size
            keys, values = k_flat[first:first + n], v_flat[first:first + n]  # [n, Hkv, D]
        else:
            own = page_table[b, :pages].long()
            keys = k_cache.index_select(0, own).flatten(0, 1)[:n]
            values = v_cache.index_select(0, own).flatten(0, 1)[:n]
        # 4-D operands: torch's fused CPU kernel (3-D ones measured 1.4x slower)
        o = F.scaled_dot_product_attention(queries[b:b + 1], keys.transpose(0, 1)[None],
                                           values.transpose(0, 1)[None], scale=scale)
        out[b] = o.reshape(num_q_heads, head_dim)  # from [1, Hkv, G, D]
    return out
