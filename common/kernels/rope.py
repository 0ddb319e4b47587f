"""Rotary position embedding, rotate-half style, applied in place to q and k."""

from __future__ import annotations

import functools

import torch


def build_cos_sin(max_positions: int, head_dim: int, theta: float,
                  device: torch.device) -> torch.Tensor:
    """-> [max_positions, head_dim] float32: cos in the first head_dim/2 columns, sin in the
    rest."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim)
    )
    positions = torch.arange(max_positions, dtype=torch.int64).to(torch.float32)
    freqs = torch.outer(positions, inv_freq)  # [P, D/2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, D]; cos, sin: [T, 1, D/2] float32
    half = x.shape[-1] // 2
    x1 = x[..., :half].float()
    x2 = x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rope_reference(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> None:
    """q: [T, Hq, D], k: [T, Hkv, D], positions: [T] int64, cos_sin: [P, D] float32; in place."""
    half = q.shape[-1] // 2
    table = cos_sin[positions]  # [T, D]
    cos = table[:, None, :half]
    sin = table[:, None, half:]
    q.copy_(_rotate(q, cos, sin))
    k.copy_(_rotate(k, cos, sin))


# --------------------------------------------------------------------------------------------
# Triton kernel, jitted on first use (TRITON_INTERPRET is read then, not at import).
# --------------------------------------------------------------------------------------------
try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without Triton keep the reference
    triton = tl = None


def _rope_kernel(
    q_ptr,  # [T, Hq, D], rotated in place
    k_ptr,  # [T, Hkv, D], rotated in place
    pos_ptr,  # [T] int64
    cos_sin_ptr,  # [max_positions, D] float32: cos | sin
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cs,
    num_q_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
):
    # One program per token: all q heads as one [BLOCK_HQ, BLOCK_HALF] tile, all k heads as another.
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_d, mask=mask_d, other=0.0)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs_d, mask=mask_d, other=0.0)[None, :]

    offs_hq = tl.arange(0, BLOCK_HQ)
    mask_q = (offs_hq < num_q_heads)[:, None] & mask_d[None, :]
    q1_ptrs = q_ptr + tok * stride_qt + offs_hq[:, None] * stride_qh + offs_d[None, :]
    q1 = tl.load(q1_ptrs, mask=mask_q, other=0.0).to(tl.float32)
    q2 = tl.load(q1_ptrs + HALF, mask=mask_q, other=0.0).to(tl.float32)
    tl.store(q1_ptrs, (q1 * cos - q2 * sin).to(q_ptr.dtype.element_ty), mask=mask_q)
    tl.store(q1_ptrs + HALF, (q2 * cos + q1 * sin).to(q_ptr.dtype.element_ty), mask=mask_q)

    offs_hk = tl.arange(0, BLOCK_HK)
    mask_k = (offs_hk < num_kv_heads)[:, None] & mask_d[None, :]
    k1_ptrs = k_ptr + tok * stride_kt + offs_hk[:, None] * stride_kh + offs_d[None, :]
    k1 = tl.load(k1_ptrs, mask=mask_k, other=0.0).to(tl.float32)
    k2 = tl.load(k1_ptrs + HALF, mask=mask_k, other=0.0).to(tl.float32)
    tl.store(k1_ptrs, (k1 * cos - k2 * sin).to(k_ptr.dtype.element_ty), mask=mask_k)
    tl.store(k1_ptrs + HALF, (k2 * cos + k1 * sin).to(k_ptr.dtype.element_ty), mask=mask_k)


@functools.cache
def _jit(fn):
    return triton.jit(fn)


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """Triton version of :func:`rope_reference`; q and k may be strided views (e.g. of a qkv)."""
    num_tokens, num_q_heads, head_dim = q.shape
    assert k.dim() == 3 and k.shape[0] == num_tokens and k.shape[2] == head_dim, (q.shape, k.shape)
    assert head_dim % 2 == 0, head_dim
    assert positions.shape == (num_tokens,) and positions.dtype == torch.int64
    assert positions.is_contiguous()
    assert cos_sin.dim() == 2 and cos_sin.shape[1] == head_dim and cos_sin.dtype == torch.float32
    assert cos_sin.stride(1) == 1
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "head_dim must be contiguous"
    assert q.is_cuda or triton.knobs.runtime.interpret, "CPU tensors need TRITON_INTERPRET=1"
    if num_tokens == 0:
        return
    half = head_dim // 2
    block_hq = triton.next_power_of_2(num_q_heads)
    block_hk = triton.next_power_of_2(k.shape[1])
    _jit(_rope_kernel)[(num_tokens,)](
        q,
        k,
        positions,
        cos_sin,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin.stride(0),
        num_q_heads,
        k.shape[1],
        HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_HQ=block_hq,
        BLOCK_HK=block_hk,
        num_warps=4 if block_hq * half <= 2048 else 8,
    )
