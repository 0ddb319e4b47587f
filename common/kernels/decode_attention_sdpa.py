"""Paged decode attention on the CPU: torch's fused scaled_dot_product_attention per sequence,
over a view of its pages where they form one run in the pool (the allocator hands pages out in
ascending runs, so they mostly do) and over a gather of its pages where they do not.

Same signature and semantics as :func:`common.kernels.decode_attention.decode_attention_reference`.
Measured on a 2-core AVX2 host (bench/step_profile.py), a view per sequence beats one batched
gather of every sequence's pages plus one masked SDPA call by 2.5-4x at batch 1-32 and 1088
tokens: the gather's copy costs more than the attention reads.

Invariants: each sequence reads exactly its first seq_lens[b] slots (a strided view that ends
there, of its run or of the gather); page-table entries past its pages are never dereferenced.
The plan is made on host copies of the table and the lengths (one ``tolist`` each per call);
per sequence only its two K/V views and its SDPA call are torch ops, and the outputs are joined
by one ``cat``. Grouped-query heads never copy K/V: float32 folds each group into the query axis
([Hkv, G, D]); half types pass [Hq, 1, D] with ``enable_gqa`` (torch's bf16 kernel is 1.6x
faster with one query row per head on this AMX CPU, fp32's 1.8x slower).
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


def _tokens(pool: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """pool: contiguous [N, S, Hkv, D] -> a view [1, Hkv, n, D] of its flat slots
    [start, start + n)."""
    _, _, heads, dim = pool.shape
    token = heads * dim
    return pool.as_strided((1, heads, n, dim), (n * token, dim, token, 1),
                           pool.storage_offset() + start * token)


def decode_attention_sdpa(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q: [B, Hq, D]; caches: contiguous [P, S, Hkv, D]; page_table: [B, max_pages] int32;
    seq_lens: [B] int32 (>= 1) -> [B, Hq, D]."""
    batch, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1:3]
    assert v_cache.shape == k_cache.shape and k_cache.shape[3] == head_dim, (q.shape,
                                                                             k_cache.shape)
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "caches are read as views"
    assert num_q_heads % num_kv_heads == 0, (num_q_heads, num_kv_heads)
    assert page_table.dim() == 2 and page_table.shape[0] == batch, (page_table.shape, batch)
    assert seq_lens.shape == (batch,), (seq_lens.shape, batch)
    assert q.dtype == k_cache.dtype == v_cache.dtype, (q.dtype, k_cache.dtype, v_cache.dtype)
    if batch == 0:
        return torch.empty_like(q)
    group = num_q_heads // num_kv_heads
    fold = q.dtype == torch.float32  # the group into the query axis; else enable_gqa
    if fold:
        queries = q.reshape(batch, num_kv_heads, group, head_dim)  # [B, Hkv, G, D]
    else:
        queries = q.unsqueeze(2)  # [B, Hq, 1, D]
    gqa = group > 1 and not fold
    outs = []
    for b, (n, row) in enumerate(zip(seq_lens.tolist(), page_table.tolist(), strict=True)):
        pages = (n + page_size - 1) // page_size
        assert 1 <= n and pages <= len(row), (n, page_table.shape)
        if is_run(row, pages):  # one ascending run of pages: read in place
            first = row[0] * page_size
            keys, values = _tokens(k_cache, first, n), _tokens(v_cache, first, n)
        else:  # gathered just before use, while the copy is still in cache
            own = page_table[b, :pages].long()
            keys = _tokens(k_cache.index_select(0, own), 0, n)
            values = _tokens(v_cache.index_select(0, own), 0, n)
        outs.append(F.scaled_dot_product_attention(queries[b:b + 1], keys, values, scale=scale,
                                                   enable_gqa=gqa))
    return torch.cat(outs).view(batch, num_q_heads, head_dim)  # from [B, Hkv, G or 1, D]
