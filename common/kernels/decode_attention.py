"""Paged attention for one query token per sequence (split-KV in the Triton version)."""

from __future__ import annotations

import functools

import torch


def decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q: [B, Hq, D]; caches: [P, S, Hkv, D]; page_table: [B, max_pages] int32;
    seq_lens: [B] int32 -> [B, Hq, D]. Reads only the first seq_lens[b] slots of row b."""
    page_size = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q)
    for b, n in enumerate(seq_lens.tolist()):
        num_pages = (n + page_size - 1) // page_size
        pages = page_table[b, :num_pages].long()
        ks = k_cache[pages].flatten(0, 1)[:n].float()  # [n, Hkv, D]
        vs = v_cache[pages].flatten(0, 1)[:n].float()
        ks = ks.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, n, D]
        vs = vs.repeat_interleave(group, dim=1).transpose(0, 1)
        scores = torch.einsum("hd,hnd->hn", q[b].float(), ks) * scale  # [Hq, n]
        probs = torch.softmax(scores, dim=-1)
        out[b] = torch.einsum("hn,hnd->hd", probs, vs).to(q.dtype)
    return out


# --------------------------------------------------------------------------------------------
# Triton kernels (split-KV paged decode), jitted on first use so that TRITON_INTERPRET is read
# then, not when this module is imported.
# --------------------------------------------------------------------------------------------
try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without Triton keep the reference
    triton = tl = None

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 64  # the reduce kernel holds all splits of one head in one tile
# GPU launch config (no autotuning: the launch must be cheap and CUDA-graph capturable).
_BLOCK_N, _NUM_WARPS, _NUM_STAGES = 64, 4, 2
_PROGRAMS_PER_SM = 4


def _decode_partial_kernel(
    q_ptr,  # [B, Hq, D]
    k_cache_ptr,  # [P, S, Hkv, D]
    v_cache_ptr,  # [P, S, Hkv, D]
    page_table_ptr,  # [B, max_pages] int32
    seq_lens_ptr,  # [B] int32
    part_o_ptr,  # [B, Hq, splits, D] float32, or out [B, Hq, D] when DIRECT
    part_lse_ptr,  # [B, Hq, splits] float32 contiguous, log2 domain (unused when DIRECT)
    stride_qb,
    stride_qh,
    stride_kc_page,
    stride_kc_off,
    stride_kc_head,
    stride_vc_page,
    stride_vc_off,
    stride_vc_head,
    stride_pt,
    stride_pb,
    stride_ph,
    stride_ps,
    page_size,
    split_size,  # tokens per split, a multiple of BLOCK_N
    qk_scale,  # softmax scale * log2(e)
    GROUP: tl.constexpr,  # Hq // Hkv
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,  # >= GROUP and >= 16 (tl.dot rows); extra rows are masked
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DIRECT: tl.constexpr,  # one split: write the normalized output, skip the reduce kernel
):
    # Program (b, kv head, split): the GROUP q heads of one kv head over one range of keys, so a
    # key/value row is loaded once per group. Keys at or past seq_len are never loaded, nor are
    # page_table entries past the last page in use.
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    n_start = split * split_size
    if n_start < seq_len:
        n_end = tl.minimum(n_start + split_size, seq_len)
        offs_g = tl.arange(0, BLOCK_G)
        mask_g = offs_g < GROUP
        heads = kv_head * GROUP + offs_g  # [BLOCK_G]
        offs_d = tl.arange(0, HEAD_DIM)
        q_ptrs = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=mask_g[:, None], other=0.0)  # [BLOCK_G, D]
        pt_row = page_table_ptr + b.to(tl.int64) * stride_pt
        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
        for n0 in range(n_start, n_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < n_end
            page = tl.load(pt_row + offs_n // page_size, mask=mask_n, other=0).to(tl.int64)
            within = offs_n % page_size
            k_rows = page * stride_kc_page + within * stride_kc_off + kv_head * stride_kc_head
            v_rows = page * stride_vc_page + within * stride_vc_off + kv_head * stride_vc_head
            k = tl.load(
                k_cache_ptr + k_rows[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0
            )  # [BLOCK_N, D]
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [G, N]
            qk = tl.where(mask_n[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))  # finite: every block has a real key
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                v_cache_ptr + v_rows[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0
            )  # [BLOCK_N, D]
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
            m_i = m_new
        o_ptrs = part_o_ptr + b.to(tl.int64) * stride_pb + heads[:, None] * stride_ph
        o_ptrs = o_ptrs + split * stride_ps + offs_d[None, :]
        out = acc / l_i[:, None]
        if DIRECT:
            tl.store(o_ptrs, out.to(part_o_ptr.dtype.element_ty), mask=mask_g[:, None])
        else:
            tl.store(o_ptrs, out, mask=mask_g[:, None])
            num_q_heads = tl.num_programs(1) * GROUP
            lse_rows = (b.to(tl.int64) * num_q_heads + heads) * tl.num_programs(2) + split
            tl.store(part_lse_ptr + lse_rows, m_i + tl.log2(l_i), mask=mask_g)


def _decode_reduce_kernel(
    part_o_ptr,  # [B, Hq, splits, D] float32
    part_lse_ptr,  # [B, Hq, splits] float32
    seq_lens_ptr,  # [B] int32
    out_ptr,  # [B, Hq, D]
    stride_ob,
    stride_oh,
    num_q_heads,
    num_splits,
    split_size,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,  # >= num_splits
):
    # Program (b, q head): merge the partial outputs of the splits that saw keys, by their LSE.
    b = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    num_active = (seq_len + split_size - 1) // split_size
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = (offs_s < num_active) & (offs_s < num_splits)
    offs_d = tl.arange(0, HEAD_DIM)
    row = (b.to(tl.int64) * num_q_heads + head) * num_splits + offs_s  # [BLOCK_S]
    lse = tl.load(part_lse_ptr + row, mask=mask_s, other=float("-inf"))
    weight = tl.where(mask_s, tl.exp2(lse - tl.max(lse, 0)), 0.0)  # [BLOCK_S]
    parts_ptrs = part_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :]
    parts = tl.load(parts_ptrs, mask=mask_s[:, None], other=0.0)  # [BLOCK_S, D]
    total = tl.sum(weight, 0)
    out = tl.sum(parts * weight[:, None], 0) / tl.where(total > 0, total, 1.0)  # [D]
    o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + head * stride_oh + offs_d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty))


@functools.cache
def _jit(fn):
    return triton.jit(fn)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _split_plan(batch: int, kv_heads: int, max_len: int, block_n: int, sms: int):
    """-> (num_splits, split_size): enough (b, kv head, split) programs to give each SM
    _PROGRAMS_PER_SM, each split at least 2 key blocks, at most _MAX_SPLITS splits."""
    blocks = triton.cdiv(max_len, block_n)
    splits = triton.cdiv(_PROGRAMS_PER_SM * sms, batch * kv_heads)
    splits = max(1, min(splits, _MAX_SPLITS, triton.cdiv(blocks, 2)))
    split_size = triton.cdiv(blocks, splits) * block_n
    return triton.cdiv(max_len, split_size), split_size


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Triton version of :func:`decode_attention_reference`. The split count is planned from
    page_table.shape[1] * page_size (a bound on seq_lens), so nothing syncs with the device and
    the launch can be captured in a CUDA graph."""
    batch, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1:3]
    assert v_cache.shape == k_cache.shape, (k_cache.shape, v_cache.shape)
    assert k_cache.shape[3] == head_dim, (q.shape, k_cache.shape)
    assert num_q_heads % num_kv_heads == 0, (num_q_heads, num_kv_heads)
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0 and head_dim <= 256, head_dim
    assert q.dtype == k_cache.dtype == v_cache.dtype, (q.dtype, k_cache.dtype)
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert page_table.dim() == 2 and page_table.shape[0] == batch
    assert page_table.dtype == torch.int32 and page_table.stride(1) == 1
    assert seq_lens.shape == (batch,) and seq_lens.dtype == torch.int32
    assert seq_lens.is_contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [B, Hq, D]
    if batch == 0:
        return out
    group = num_q_heads // num_kv_heads
    interpret = triton.knobs.runtime.interpret
    assert q.is_cuda or interpret, "CPU tensors need TRITON_INTERPRET=1"
    # Under the interpreter: small blocks and a pretend SM count, so short test sequences still
    # take the multi-split path.
    block_n = 16 if interpret else _BLOCK_N
    sms = 16 if interpret else _num_sms(q.device.index or 0)
    max_len = max(page_table.shape[1] * page_size, 1)
    num_splits, split_size = _split_plan(batch, num_kv_heads, max_len, block_n, sms)
    direct = num_splits == 1
    if direct:
        part_o, part_lse = out, out
        stride_p = (out.stride(0), out.stride(1), 0)
    else:
        part_o = torch.empty(  # [B, Hq, splits, D]
            (batch, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        part_lse = part_o.new_empty((batch, num_q_heads, num_splits))  # [B, Hq, splits]
        stride_p = part_o.stride()[:3]
    _jit(_decode_partial_kernel)[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        page_table,
        seq_lens,
        part_o,
        part_lse,
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        page_table.stride(0),
        *stride_p,
        page_size,
        split_size,
        scale * _LOG2E,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DIRECT=direct,
        num_warps=_NUM_WARPS,
        num_stages=_NUM_STAGES,
    )
    if not direct:
        _jit(_decode_reduce_kernel)[(batch, num_q_heads)](
            part_o,
            part_lse,
            seq_lens,
            out,
            out.stride(0),
            out.stride(1),
            num_q_heads,
            num_splits,
            split_size,
            HEAD_DIM=head_dim,
            BLOCK_S=triton.next_power_of_2(num_splits),
            num_warps=4,
        )
    return out
