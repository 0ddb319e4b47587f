"""Causal attention of a chunk of prompt tokens over a sequence's pages (chunked prefill).

Query ``i`` of sequence ``b`` sits at absolute position ``context_lens[b] + i`` and attends to
keys ``[0, context_lens[b] + i]``, every one of them read from the sequence's pages: the caller
stores the chunk's own K/V into the pages before the call. No slot at or past
``context_lens[b] + chunk_len_b`` is read, nor a page-table entry past the pages those hold.
"""

from __future__ import annotations

import functools

import torch


def paged_prefill_attention_reference(
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
    [B + 1] int32; context_lens: [B] int32 -> [T, Hq, D] (float32 math)."""
    del max_seqlen_q
    page_size = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q)
    bounds = cu_seqlens_q.tolist()
    for b, (start, end, ctx) in enumerate(zip(bounds[:-1], bounds[1:], context_lens.tolist())):
        n = end - start
        if n == 0:
            continue
        total = ctx + n
        pages = page_table[b, : (total + page_size - 1) // page_size].long()
        ks = k_cache[pages].flatten(0, 1)[:total].float()  # [total, Hkv, D]
        vs = v_cache[pages].flatten(0, 1)[:total].float()
        ks = ks.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, total, D]
        vs = vs.repeat_interleave(group, dim=1).transpose(0, 1)
        qs = q[start:end].float().transpose(0, 1)  # [Hq, n, D]
        scores = torch.matmul(qs, ks.transpose(1, 2)) * scale  # [Hq, n, total]
        rows = ctx + torch.arange(n, device=q.device)[:, None]  # [n, 1] absolute positions
        visible = torch.arange(total, device=q.device)[None, :] <= rows  # [n, total]
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.matmul(probs, vs).transpose(0, 1).to(q.dtype)
    return out


# --------------------------------------------------------------------------------------------
# Triton kernel (flash-attention forward over paged keys, causal, ragged, GQA), jitted on first
# use so that TRITON_INTERPRET is read then, not when this module is imported.
# --------------------------------------------------------------------------------------------
try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without Triton keep the reference
    triton = tl = None

_LOG2E = 1.4426950408889634


def _paged_prefill_kernel(
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [P, S, Hkv, D]
    v_cache_ptr,  # [P, S, Hkv, D]
    o_ptr,  # [T, Hq, D]
    page_table_ptr,  # [B, max_pages] int32
    cu_seqlens_ptr,  # [B + 1] int32
    context_lens_ptr,  # [B] int32
    stride_qt,
    stride_qh,
    stride_kc_page,
    stride_kc_off,
    stride_kc_head,
    stride_vc_page,
    stride_vc_off,
    stride_vc_head,
    stride_ot,
    stride_oh,
    stride_pt,
    page_size,
    qk_scale,  # softmax scale * log2(e): the softmax runs in base 2
    seq_bucket,  # unused in the body: an autotuning key (power of two of max_seqlen_q)
    GROUP: tl.constexpr,  # Hq // Hkv
    HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Grid (query blocks, sequences, q heads); query blocks run last-first (most keys first).
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    start = tl.load(cu_seqlens_ptr + seq)
    seqlen = tl.load(cu_seqlens_ptr + seq + 1) - start
    ctx = tl.load(context_lens_ptr + seq)
    m0 = pid_m * BLOCK_M
    if m0 < seqlen:
        kv_len = ctx + seqlen  # keys [0, kv_len) are in the pages; nothing past is read
        offs_m = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M] chunk-relative rows
        pos_m = ctx + offs_m  # [BLOCK_M] absolute positions
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        row0 = start.to(tl.int64)
        kv_head = head // GROUP
        pt_row = page_table_ptr + seq.to(tl.int64) * stride_pt
        mask_m = offs_m < seqlen
        q_ptrs = q_ptr + row0 * stride_qt + head * stride_qh
        q_ptrs = q_ptrs + offs_m[:, None] * stride_qt + offs_d[None, :]
        q = tl.load(q_ptrs, mask=mask_m[:, None], other=0.0)  # [BLOCK_M, D]
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

        # Stage 1: whole key blocks below the block's first position (ctx + m0 < kv_len), which
        # every row sees: no masks.
        full_end = ((ctx + m0) // BLOCK_N) * BLOCK_N
        for n0 in range(0, full_end, BLOCK_N):
            cols = n0 + offs_n  # [BLOCK_N] absolute key positions
            page = tl.load(pt_row + cols // page_size).to(tl.int64)
            within = cols % page_size
            k_rows = page * stride_kc_page + within * stride_kc_off + kv_head * stride_kc_head
            v_rows = page * stride_vc_page + within * stride_vc_off + kv_head * stride_vc_head
            k = tl.load(k_cache_ptr + k_rows[:, None] + offs_d[None, :])  # [BLOCK_N, D]
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, N]
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_cache_ptr + v_rows[:, None] + offs_d[None, :])  # [BLOCK_N, D]
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
            m_i = m_new

        # Stage 2: the blocks up to the block's last row, causal mask and sequence end. The
        # first of them holds key full_end <= ctx + m0, which every row sees, so m_i is finite
        # from there on.
        hi = tl.minimum(ctx + m0 + BLOCK_M, kv_len)
        for n0 in range(full_end, hi, BLOCK_N):
            cols = n0 + offs_n
            mask_n = cols < kv_len
            page = tl.load(pt_row + cols // page_size, mask=mask_n, other=0).to(tl.int64)
            within = cols % page_size
            k_rows = page * stride_kc_page + within * stride_kc_off + kv_head * stride_kc_head
            v_rows = page * stride_vc_page + within * stride_vc_off + kv_head * stride_vc_head
            k = tl.load(
                k_cache_ptr + k_rows[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0
            )  # [BLOCK_N, D]
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            visible = (pos_m[:, None] >= cols[None, :]) & mask_n[None, :]
            qk = tl.where(visible, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                v_cache_ptr + v_rows[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0
            )  # [BLOCK_N, D]
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
            m_i = m_new

        acc = acc / l_i[:, None]
        o_ptrs = o_ptr + row0 * stride_ot + head * stride_oh
        o_ptrs = o_ptrs + offs_m[:, None] * stride_ot + offs_d[None, :]
        tl.store(o_ptrs, acc.to(o_ptr.dtype.element_ty), mask=mask_m[:, None])


def _prune_configs(configs, named_args, **kwargs):
    head_dim = kwargs.get("HEAD_DIM", named_args.get("HEAD_DIM", 128))
    keep = [
        c
        for c in configs
        if c.kwargs["BLOCK_M"] * head_dim <= 128 * 128  # fp32 accumulator fits in registers
        and c.kwargs["BLOCK_N"] * head_dim <= 128 * 128
    ]
    return keep or configs[:1]


@functools.cache
def _kernel(interpret: bool):
    jitted = triton.jit(_paged_prefill_kernel)
    if interpret:  # one fixed config; blocks of 16 so short test prompts cross block edges
        return jitted, {"BLOCK_M": 16, "BLOCK_N": 16}
    configs = [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=bm // 16, num_stages=s)
        for bm in (64, 128)
        for bn in (32, 64)
        for s in (2, 3)
    ]
    tuned = triton.autotune(
        configs,
        key=["seq_bucket", "HEAD_DIM", "GROUP", "DOT_PRECISION"],
        prune_configs_by={"early_config_prune": _prune_configs},
    )(jitted)
    return tuned, {}


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
) -> torch.Tensor:
    """Triton version of :func:`paged_prefill_attention_reference`. ``max_seqlen_q`` must be >=
    the longest chunk (it sizes the grid); rows past a chunk's length are never touched."""
    num_tokens, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1:3]
    batch = cu_seqlens_q.numel() - 1
    assert v_cache.shape == k_cache.shape, (k_cache.shape, v_cache.shape)
    assert k_cache.shape[3] == head_dim, (q.shape, k_cache.shape)
    assert num_q_heads % num_kv_heads == 0, (num_q_heads, num_kv_heads)
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0 and head_dim <= 256, head_dim
    assert q.dtype == k_cache.dtype == v_cache.dtype, (q.dtype, k_cache.dtype, v_cache.dtype)
    assert q.dtype in (torch.float16, torch.bfloat16, torch.float32), q.dtype
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert page_table.dim() == 2 and page_table.shape[0] == batch, (page_table.shape, batch)
    assert page_table.dtype == torch.int32 and page_table.stride(1) == 1
    assert cu_seqlens_q.dim() == 1 and cu_seqlens_q.dtype == torch.int32
    assert cu_seqlens_q.is_contiguous()
    assert context_lens.shape == (batch,) and context_lens.dtype == torch.int32
    assert context_lens.is_contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, Hq, D]
    if num_tokens == 0 or batch == 0 or max_seqlen_q <= 0:
        return out
    interpret = triton.knobs.runtime.interpret
    assert q.is_cuda or interpret, "CPU tensors need TRITON_INTERPRET=1"
    kernel, fixed = _kernel(interpret)
    seq_bucket = min(max(triton.next_power_of_2(max_seqlen_q), 256), 16384)

    def grid(meta):
        return (triton.cdiv(max_seqlen_q, meta["BLOCK_M"]), batch, num_q_heads)

    kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        page_table,
        cu_seqlens_q,
        context_lens,
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        out.stride(0),
        out.stride(1),
        page_table.stride(0),
        page_size,
        scale * _LOG2E,
        seq_bucket,
        GROUP=num_q_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        **fixed,
    )
    return out
