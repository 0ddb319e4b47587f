"""Row helpers for the CPU kernels compiled by numba (common/kernels/*_numba.py).

numba has no bfloat16, so a bfloat16 tensor reaches a kernel as its uint16 bits (`bits_view`),
and a kernel widens each row into a float32 scratch row and rounds results back through the
bits of that row, the way torch converts: widening is exact (the 16 bits are a float32's top
half), narrowing rounds to nearest, ties to even, and a NaN stays a quiet NaN.

Kernels are compiled on first use and cached beside their source (`kernel`); where the
install cannot be written (a read-only image) and no per-user cache exists, each process
compiles them again instead (a second or two, in the services' warm-up).

Invariants: the helpers read and write only the rows they are given; `round_row` leaves the
rounded values in the scratch row as float32 (so a kernel can go on computing in the precision
torch would see after its own rounding) and returns nothing.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

_SHIFT = np.uint32(16)
_HALF_ULP = np.uint32(0x7FFF)
_ONE = np.uint32(1)
_ABS = np.uint32(0x7FFFFFFF)
_INF = np.uint32(0x7F800000)
_QUIET = np.uint32(0x00400000)
_LOW = np.uint32(0xFFFF0000)


def kernel(**options):
    """numba.njit with on-disk caching where a cache location exists, else without: a read-only
    install must still run (numba refuses `cache=True` there at decoration time)."""
    def compile_it(fn):
        try:
            return numba.njit(cache=True, **options)(fn)
        except RuntimeError:  # "cannot cache function ...: no locator available"
            return numba.njit(cache=False, **options)(fn)
    return compile_it


def bits_view(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor -> the numpy array numba kernels take: its own values for float32, its
    uint16 bits for bfloat16 (the same memory, no copy)."""
    return t.view(torch.uint16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


@numba.njit(inline="always")
def _nearest_even(u):
    """float32 bits -> the bits of the nearest bfloat16 (in the top half, low half zero)."""
    if (u & _ABS) > _INF:  # NaN: quiet, as torch rounds it
        return (u | _QUIET) & _LOW
    return (u + _HALF_ULP + ((u >> _SHIFT) & _ONE)) & _LOW


@numba.njit(inline="always")
def widen_row(src, scratch_bits):
    """src: [H] uint16 bfloat16 bits -> scratch_bits: [H] uint32, the float32 bits."""
    for i in range(src.shape[0]):
        scratch_bits[i] = np.uint32(src[i]) << _SHIFT


@numba.njit(inline="always")
def round_row(scratch_bits):
    """scratch_bits: [H] uint32 float32 bits, rounded to bfloat16 precision in place."""
    for i in range(scratch_bits.shape[0]):
        scratch_bits[i] = _nearest_even(scratch_bits[i])


@numba.njit(inline="always")
def narrow_row(scratch_bits, dst):
    """scratch_bits: [H] uint32 float32 bits -> dst: [H] uint16, rounded to bfloat16."""
    for i in range(dst.shape[0]):
        dst[i] = np.uint16(_nearest_even(scratch_bits[i]) >> _SHIFT)
