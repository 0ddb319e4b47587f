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

from common.kernels.numba_rows import (address, f32_at, kernel, narrow_row, round_row, u16_at,
                                       widen_row)

_SUM = {"reassoc"}  # the sum of squares may be reordered (vectorised); nothing else


@kernel(fastmath=_SUM)
def _rmsnorm_bf16(x_at, residual_at, weight_at, out_at, summed_at, num_rows, width, eps):
    # x, residual, out, summed: [T, H]; weight: [H]; bfloat16 bits; residual_at 0: none
    x = u16_at(x_at, (num_rows, width))
    out = u16_at(out_at, (num_rows, width))
    weight = u16_at(weight_at, (width,))
    row = np.empty(width, np.uint32)
    row_f = row.view(np.float32)
    other = np.empty(width, np.uint32)
    other_f = other.view(np.float32)
    w = np.empty(width, np.uint32)
    widen_row(weight, w)
    w_f = w.view(np.float32)
    for t in range(num_rows):
        widen_row(x[t], row)
        if residual_at != 0:
            residual = u16_at(residual_at, (num_rows, width))
            summed = u16_at(summed_at, (num_rows, width))
            widen_row(residual[t], other)
            for i in range(width):
                row_f[i] = row_f[i] + other_f[i]
            round_row(row)
            narrow_row(row, summed[t])
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
def _rmsnorm_f32(x_at, residual_at, weight_at, out_at, summed_at, num_rows, width, eps):
    # x, residual, out, summed: [T, H]; weight: [H]; float32; residual_at 0: none
    x = f32_at(x_at, (num_rows, width))
    out = f32_at(out_at, (num_rows, width))
    weight = f32_at(weight_at, (width,))
    for t in range(num_rows):
        src = x[t]
        if residual_at != 0:
            residual = f32_at(residual_at, (num_rows, width))
            summed = f32_at(summed_at, (num_rows, width))
            for i in range(width):
                summed[t, i] = x[t, i] + residual[t, i]
            src = summed[t]
        total = np.float32(0.0)
        for i in range(width):
            total += src[i] * src[i]
        inv = np.float32(1.0) / np.sqrt(total / np.float32(width) + np.float32(eps))
        for i in range(width):
            out[t, i] = weight[i] * (src[i] * inv)


def supports(x: torch.Tensor) -> bool:
    return x.is_cpu and (x.dtype is torch.float32 or x.dtype is torch.bfloat16)


def rmsnorm_numba(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x, residual: [T, H]; weight: [H], all one dtype (`supports`) -> (weight * normed:
    [T, H], x + residual or None)."""
    assert supports(x) and weight.dtype is x.dtype, (x.dtype, weight.dtype, x.device)
    num_rows, width = x.shape
    assert weight.shape == (width,), (x.shape, weight.shape)
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    summed = None
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype is x.dtype
        residual = residual.contiguous()
        summed = torch.empty_like(x)
    kernel_fn = _rmsnorm_bf16 if x.dtype is torch.bfloat16 else _rmsnorm_f32
    kernel_fn(address(x), 0 if residual is None else address(residual), address(weight),
              address(out), 0 if summed is None else address(summed), num_rows, width,
              float(eps))
    return out, summed
