"""Paged decode attention on the CPU as one compiled loop over the whole batch (numba,
common/kernels/numba_cpu.py), float32 only.

Same signature and semantics as
:func:`common.kernels.decode_attention.decode_attention_reference`, within float32 rounding (the
loop sums in its own order; tests/kernels/test_decode_attention_numba.py holds it to the
reference). For each sequence it walks the sequence's slots in token order through the page
table, every head of a slot at once (a slot's K or V is one contiguous run), once for the scores
and once for the values, with the query rows in a scratch copy: nothing is gathered or copied,
and there is no torch op per sequence. Measured on a 2-core AVX2 host (bench/step_ab.py, one
thread, thread clock, 8-layer bench checkpoint), against the per-sequence SDPA calls of
decode_attention_sdpa.py: decode attention per step 2.9 vs 7.2 ms at batch 8 and 160 tokens,
16.3 vs 33.4 ms at 1088 (where it reads the KV at about the host's memory bandwidth), 0.58 vs
1.18 ms at batch 1 and 160 tokens.

Invariants: each sequence reads exactly its first seq_lens[b] slots, through the first
ceil(seq_lens[b] / S) entries of its page-table row; the loop checks every length and every
entry in use against the table's width and the pool before it reads a slot, and refuses
(IndexError, nothing written) instead of reading raw memory outside the pool.
"""

from __future__ import annotations

import torch

from common.kernels.numba_cpu import address, decode_attention_f32


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             page_table: torch.Tensor, seq_lens: torch.Tensor) -> bool:
    """Whether decode_attention_numba takes these: float32 CPU q (head_dim contiguous) and
    contiguous caches of one shape, an int32 table and int32 lengths on the CPU."""
    return (q.dtype is torch.float32 and k_cache.dtype is torch.float32
            and v_cache.dtype is torch.float32 and q.is_cpu and k_cache.is_cpu
            and v_cache.is_cpu and page_table.is_cpu and seq_lens.is_cpu
            and page_table.dtype is torch.int32 and seq_lens.dtype is torch.int32
            and q.dim() == 3 and k_cache.dim() == 4 and v_cache.shape == k_cache.shape
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and (q.shape[2] <= 1 or q.stride(2) == 1))


def decode_attention_numba(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q: [B, Hq, D]; caches: contiguous [P, S, Hkv, D]; page_table: [B, max_pages] int32;
    seq_lens: [B] int32 (>= 1) -> [B, Hq, D] float32, as `supports` says. Raises ValueError
    for other arguments and IndexError (nothing computed) for a length or page entry the pool
    and table do not hold."""
    if not supports(q, k_cache, v_cache, page_table, seq_lens):
        raise ValueError("decode_attention_numba: float32 CPU q [B, Hq, D] (D contiguous), "
                         "contiguous caches [P, S, Hkv, D] of one shape, int32 table and lengths")
    batch, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads = k_cache.shape[:3]
    if (k_cache.shape[3] != head_dim or num_q_heads % num_kv_heads
            or page_table.dim() != 2 or page_table.shape[0] != batch
            or seq_lens.shape != (batch,)):
        raise ValueError(f"decode_attention_numba: q {tuple(q.shape)}, caches "
                         f"{tuple(k_cache.shape)}, table {tuple(page_table.shape)}, lengths "
                         f"{tuple(seq_lens.shape)} do not agree")
    out = torch.empty(batch, num_q_heads, head_dim, dtype=torch.float32)
    if batch == 0:
        return out
    table, lens = page_table.contiguous(), seq_lens.contiguous()
    strides = (q.stride(0), q.stride(1))
    extent = (batch - 1) * strides[0] + (num_q_heads - 1) * strides[1] + head_dim
    refused = decode_attention_f32(address(q), extent, strides, address(k_cache),
                                   address(v_cache), num_pages, address(table), table.shape[1],
                                   address(lens), address(out), batch, num_q_heads,
                                   num_kv_heads, head_dim, page_size, float(scale))
    if refused == 1:
        raise IndexError(f"decode_attention_numba: a sequence length below 1 or past the "
                         f"table's {table.shape[1]} pages of {page_size} slots")
    if refused == 2:
        raise IndexError(f"decode_attention_numba: a page entry in use outside the pool's "
                         f"{num_pages} pages")
    return out
