"""RMSNorm (residual add fused) on the CPU as one compiled loop per row (numba): the residual
add, the float32 normalisation, the rounding to x's dtype and the weight's multiply in one pass
over each row, instead of about ten torch ops with a temporary each.

Same signature and semantics as :func:`common.kernels.rmsnorm.rmsnorm_reference`: adds in x's
dtype (a bfloat16 sum rounded once), normalizes in float32, rounds once to x's dtype, then
multiplies by the weight (a bfloat16 product rounded once). Differs from it only in the order of
the float32 sum of squares (one row's, vectorised): bit for bit equal in bfloat16 in the tests,
within an ulp of float32 (tests/kernels/test_numba_kernels.py). float32 and bfloat16 only
(`supports`); x, residual and weight are never written.
"""

from __future__ import annotations

import numpy as np
import torch

from common.kernels.numba_rows import bits_view, kernel, narrow_row, round_row, widen_row

_SUM = {"reassoc"}  # the sum of squares may be reordered (vectorised); nothing else


@kernel(fastmath=_SUM)
def _rmsnorm_bf16(x, residual, weight, eps, out, residual_out, has_residual):
    # x, residual, out, residual_out: [T, H] uint16; weight: [H] uint16 (bfloat16 bits)
    num_rows, width = x.shape
    row = np.empty(width, np.uint32)
    row_f = row.view(np.float32)
    other = np.empty(width, np.uint32)
    other_f = other.view(np.float32)
    w = np.empty(width, np.uint32)
    widen_row(weight, w)
    w_f = w.view(np.float32)
    for t in range(num_rows):
        widen_row(x[t], row)
        if has_residual:
            widen_row(residual[t], other)
            for i in range(width):
                row_f[i] = row_f[i] + other_f[i]
            round_row(row)
            narrow_row(row, residual_out[t])
        total = np.float32(0.0)
        for i in range(width):
            total += row_f[i] * row_f[i]
        inv = np.float32(1.0) / np.sqrt(total / np.float32(width) + np.float32(eps))
        for i in range(width):
            row_f[i] = row_f[i] * inv
        round_row(row)
        for i in range(width):
            row_f[i] = w_f[i] * row_f[i]
        narrow_row(row, out[t])


@kernel(fastmath=_SUM)
def _rmsnorm_f32(x, residual, weight, eps, out, residual_out, has_residual):
    # x, residual, out, residual_out: [T, H] float32; weight: [H] float32
    num_rows, width = x.shape
    for t in range(num_rows):
        src = x[t]
        if has_residual:
            for i in range(width):
                residual_out[t, i] = x[t, i] + residual[t, i]
            src = residual_out[t]
        total = np.float32(0.0)
        for i in range(width):
            total += src[i] * src[i]
        inv = np.float32(1.0) / np.sqrt(total / np.float32(width) + np.float32(eps))
        for i in range(width):
            out[t, i] = weight[i] * (src[i] * inv)


def supports(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)


def rmsnorm_numba(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x, residual: [T, H]; weight: [H], all one dtype (`supports`) -> (weight * normed:
    [T, H], x + residual or None)."""
    assert supports(x) and weight.dtype == x.dtype, (x.dtype, weight.dtype, x.device)
    assert x.dim() == 2 and weight.shape == (x.shape[1],), (x.shape, weight.shape)
    x = x.contiguous()
    out = torch.empty_like(x)
    summed = None
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        residual = residual.contiguous()
        summed = torch.empty_like(x)
    kernel = _rmsnorm_bf16 if x.dtype == torch.bfloat16 else _rmsnorm_f32
    kernel(bits_view(x), bits_view(residual if residual is not None else x),
           bits_view(weight.contiguous()), float(eps), bits_view(out),
           bits_view(summed if summed is not None else out), residual is not None)
    return out, summed
