"""RMSNorm with the residual add fused."""

from __future__ import annotations

import functools

import torch


def rmsnorm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x, residual: [T, H]; weight: [H]. Adds in x's dtype, normalizes in float32 (as
    transformers does)."""
    if residual is not None:
        x = x + residual
        residual = x
    x32 = x.float()
    variance = x32.pow(2).mean(dim=-1, keepdim=True)
    normed = (x32 * torch.rsqrt(variance + eps)).to(x.dtype)
    return weight * normed, residual


# --------------------------------------------------------------------------------------------
# Triton kernel, jitted on first use (TRITON_INTERPRET is read then, not at import).
# --------------------------------------------------------------------------------------------
try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without Triton keep the reference
    triton = tl = None


def _rmsnorm_kernel(
    x_ptr,  # [T, H]
    residual_ptr,  # [T, H] (unused without HAS_RESIDUAL)
    weight_ptr,  # [H]
    out_ptr,  # [T, H]
    new_residual_ptr,  # [T, H] (unused without HAS_RESIDUAL)
    stride_x,
    stride_r,
    stride_out,
    stride_nr,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # One program per row; the whole row stays in registers.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        # Round the sum to x's dtype first, as the reference adds in x's dtype.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * stride_nr + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, axis=0) / hidden
    normed = (x32 * tl.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _jit(fn):
    return triton.jit(fn)


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton version of :func:`rmsnorm_reference`; x may have any leading dims."""
    hidden = x.shape[-1]
    assert weight.shape == (hidden,) and weight.is_contiguous(), (weight.shape, x.shape)
    assert x.dtype.is_floating_point and weight.dtype.is_floating_point
    assert x.is_cuda or triton.knobs.runtime.interpret, "CPU tensors need TRITON_INTERPRET=1"
    x2 = x.reshape(-1, hidden)  # [T, H]
    assert x2.stride(-1) == 1
    out_dtype = torch.promote_types(weight.dtype, x.dtype)  # as `weight * normed`
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)  # [T, H]
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, (residual.shape, x.shape)
        r2 = residual.reshape(-1, hidden)  # [T, H]
        assert r2.stride(-1) == 1
        new_residual = torch.empty_like(x2)  # [T, H]
    else:
        r2 = new_residual = x2
    if x2.shape[0] > 0:
        block_h = triton.next_power_of_2(hidden)
        num_warps = min(max(block_h // 256, 1), 16)
        _jit(_rmsnorm_kernel)[(x2.shape[0],)](
            x2,
            r2,
            weight,
            out,
            new_residual,
            x2.stride(0),
            r2.stride(0),
            out.stride(0),
            new_residual.stride(0),
            hidden,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK_H=block_h,
            num_warps=num_warps,
        )
    out = out.view(x.shape)
    if residual is None:
        return out, None
    return out, new_residual.view(x.shape)
