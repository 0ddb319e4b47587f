"""RMSNorm (residual add fused) on the CPU as one compiled loop per row (numba,
common/kernels/numba_cpu.py): the residual add, the float32 normalisation, the rounding to x's
dtype and the weight's multiply in one pass over each row, instead of about ten torch ops with a
temporary each.

Same signature and semantics as :func:`common.kernels.rmsnorm.rmsnorm_reference`: adds in x's
dtype (a bfloat16 sum rounded once), normalizes in float32, rounds once to x's dtype, then
multiplies by the weight (a bfloat16 product rounded once). It differs from the in-place torch
kernel only in the order of each row's float32 sum of squares: bfloat16 results equal it but
where that moves a value across a rounding boundary, float32 ones lie within a few ulp
(tests/kernels/test_numba_kernels.py measures both). float32 and bfloat16 only (`supports`);
x, residual and weight are never written.
"""

from __future__ import annotations

import torch

from common.kernels.numba_cpu import address, rmsnorm_bf16, rmsnorm_f32


def supports(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """Whether rmsnorm_numba takes these: CPU tensors of one dtype, float32 or bfloat16."""
    return (x.dtype in (torch.float32, torch.bfloat16) and x.is_cpu and weight.is_cpu
            and weight.dtype is x.dtype
            and (residual is None or (residual.is_cpu and residual.dtype is x.dtype)))


def rmsnorm_numba(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x, residual: [T, H]; weight: [H] (`supports`) -> (weight * normed: [T, H],
    x + residual or None). Raises ValueError for anything else: the loop reads raw memory."""
    if not supports(x, weight, residual):
        raise ValueError(f"rmsnorm_numba: CPU float32/bfloat16 tensors of one dtype, got "
                         f"x {x.dtype} on {x.device}, weight {weight.dtype} on {weight.device}")
    if x.dim() != 2 or weight.shape != (x.shape[1],) or (
            residual is not None and residual.shape != x.shape):
        raise ValueError(f"rmsnorm_numba: x [T, H], weight [H], residual like x; got "
                         f"{tuple(x.shape)}, {tuple(weight.shape)}, "
                         f"{None if residual is None else tuple(residual.shape)}")
    num_rows, width = x.shape
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    summed = None
    if residual is not None:
        residual = residual.contiguous()
        summed = torch.empty_like(out)
    loop = rmsnorm_bf16 if x.dtype is torch.bfloat16 else rmsnorm_f32
    loop(address(x), 0 if residual is None else address(residual), address(weight),
         address(out), 0 if summed is None else address(summed), num_rows, width, float(eps))
    return out, summed
