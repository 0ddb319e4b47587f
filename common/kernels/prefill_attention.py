"""Causal attention over a ragged batch of prompts, grouped-query heads."""

from __future__ import annotations

import functools

import torch


def prefill_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D]; cu_seqlens: [B + 1] int32 -> [T, Hq, D] (float32 math)."""
    del max_seqlen
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        n = end - start
        if n == 0:
            continue
        qs = q[start:end].float().transpose(0, 1)  # [Hq, n, D]
        ks = k[start:end].float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, n, D]
        vs = v[start:end].float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = torch.matmul(qs, ks.transpose(1, 2)) * scale  # [Hq, n, n]
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.matmul(probs, vs).transpose(0, 1).to(q.dtype)
    return out


# --------------------------------------------------------------------------------------------
# Triton kernel (flash-attention forward, causal, ragged, GQA), jitted on first use so that
# TRITON_INTERPRET is read then, not when this module is imported.
# --------------------------------------------------------------------------------------------
try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without Triton keep the reference
    triton = tl = None

_LOG2E = 1.4426950408889634


def _prefill_attention_kernel(
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [T, Hkv, D]
    v_ptr,  # [T, Hkv, D]
    o_ptr,  # [T, Hq, D]
    cu_seqlens_ptr,  # [B + 1] int32
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    qk_scale,  # softmax scale * log2(e): the softmax runs in base 2
    seq_bucket,  # unused in the body: an autotuning key (power of two of max_seqlen)
    GROUP: tl.constexpr,  # Hq // Hkv
    HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Grid (query blocks, sequences, q heads). Query blocks run last-first: the blocks with the
    # most keys under the causal mask start first, which balances the tail of the launch.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    start = tl.load(cu_seqlens_ptr + seq)
    seqlen = tl.load(cu_seqlens_ptr + seq + 1) - start
    m0 = pid_m * BLOCK_M
    if m0 < seqlen:
        offs_m = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M] sequence-relative rows
        offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
        offs_d = tl.arange(0, HEAD_DIM)  # [D]
        row0 = start.to(tl.int64)
        kv_head = head // GROUP
        q_base = q_ptr + row0 * stride_qt + head * stride_qh
        k_base = k_ptr + row0 * stride_kt + kv_head * stride_kh
        v_base = v_ptr + row0 * stride_vt + kv_head * stride_vh
        mask_m = offs_m < seqlen
        q_ptrs = q_base + offs_m[:, None] * stride_qt + offs_d[None, :]
        q = tl.load(q_ptrs, mask=mask_m[:, None], other=0.0)  # [BLOCK_M, D]
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

        # Stage 1: key blocks wholly below the diagonal (all keys < m0 < seqlen): no masks.
        for n0 in range(0, m0, BLOCK_N):
            cols = n0 + offs_n
            k = tl.load(k_base + cols[:, None] * stride_kt + offs_d[None, :])  # [BLOCK_N, D]
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, N]
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + cols[:, None] * stride_vt + offs_d[None, :])  # [BLOCK_N, D]
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
            m_i = m_new

        # Stage 2: the diagonal blocks, causal mask and sequence end. Every row keeps >= 1 key.
        hi = tl.minimum(m0 + BLOCK_M, seqlen)
        for n0 in range(m0, hi, BLOCK_N):
            cols = n0 + offs_n
            mask_n = cols < seqlen
            k_ptrs = k_base + cols[:, None] * stride_kt + offs_d[None, :]
            k = tl.load(k_ptrs, mask=mask_n[:, None], other=0.0)  # [BLOCK_N, D]
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            visible = (offs_m[:, None] >= cols[None, :]) & mask_n[None, :]
            qk = tl.where(visible, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v_ptrs = v_base + cols[:, None] * stride_vt + offs_d[None, :]
            v = tl.load(v_ptrs, mask=mask_n[:, None], other=0.0)  # [BLOCK_N, D]
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
        if c.kwargs["BLOCK_M"] % c.kwargs["BLOCK_N"] == 0  # stage 1 ends on a BLOCK_N boundary
        and c.kwargs["BLOCK_M"] * head_dim <= 128 * 128  # fp32 accumulator fits in registers
        and c.kwargs["BLOCK_N"] * head_dim <= 128 * 128
    ]
    return keep or configs[:1]


@functools.cache
def _kernel(interpret: bool):
    jitted = triton.jit(_prefill_attention_kernel)
    if interpret:  # the interpreter gets one fixed config: autotuning there is only slow
        return jitted, {"BLOCK_M": 32, "BLOCK_N": 32}
    configs = [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=bm // 16, num_stages=s)
        for bm in (64, 128)
        for bn in (32, 64, 128)
        for s in (2, 3)
    ]
    tuned = triton.autotune(
        configs,
        key=["seq_bucket", "HEAD_DIM", "GROUP", "DOT_PRECISION"],
        prune_configs_by={"early_config_prune": _prune_configs},
    )(jitted)
    return tuned, {}


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
) -> torch.Tensor:
    """Triton version of :func:`prefill_attention_reference`. ``max_seqlen`` must be >= the
    longest sequence (it sizes the grid); rows past a sequence's length are never touched."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == v.shape == (num_tokens, num_kv_heads, head_dim), (q.shape, k.shape, v.shape)
    assert num_q_heads % num_kv_heads == 0, (num_q_heads, num_kv_heads)
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0 and head_dim <= 256, head_dim
    assert q.dtype == k.dtype == v.dtype, (q.dtype, k.dtype, v.dtype)
    assert q.dtype in (torch.float16, torch.bfloat16, torch.float32), q.dtype
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1, "head_dim not contiguous"
    assert cu_seqlens.dim() == 1 and cu_seqlens.dtype == torch.int32 and cu_seqlens.is_contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, Hq, D]
    batch = cu_seqlens.numel() - 1
    if num_tokens == 0 or batch == 0 or max_seqlen <= 0:
        return out
    interpret = triton.knobs.runtime.interpret
    assert q.is_cuda or interpret, "CPU tensors need TRITON_INTERPRET=1"
    kernel, fixed = _kernel(interpret)
    seq_bucket = min(max(triton.next_power_of_2(max_seqlen), 256), 16384)

    def grid(meta):
        return (triton.cdiv(max_seqlen, meta["BLOCK_M"]), batch, num_q_heads)

    kernel[grid](
        q,
        k,
        v,
        out,
        cu_seqlens,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        scale * _LOG2E,
        seq_bucket,
        GROUP=num_q_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        **fixed,
    )
    return out
