"""Row helpers for the CPU kernels compiled by numba (common/kernels/*_numba.py).

numba has no bfloat16, so a bfloat16 tensor reaches a kernel as its uint16 bits, and a kernel
widens each row into a float32 scratch row and rounds results back through the
bits of that row, the way torch converts: widening is exact (the 16 bits are a float32's top
half), narrowing rounds to nearest, ties to even, and a NaN stays a quiet NaN.

A tensor reaches a kernel as its address (`address`) and the kernel sees it as an array again
(`u16_at`, `f32_at`): a numpy view per argument (`Tensor.view(...).numpy()` and numba's typing
of it) cost ~2.5 us each, which at decode's batch sizes was more than the loop itself. The
caller keeps the tensor alive for the call and states its shape; the kernels read and write
only within it.

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
from numba.core import cgutils, types
from numba.extending import intrinsic

_SHIFT = np.uint32(16)
_HALF_ULP = np.uint32(0x7FFF)
_ONE = np.uint32(1)
_ABS = np.uint32(0x7FFFFFFF)
_INF = np.uint32(0x7F800000)
_QUIET = np.uint32(0x00400000)
_LOW = np.uint32(0xFFFF0000)


def kernel(**options):
    """numba.njit releasing the GIL (the services' event loop runs beside the engine thread, as
    it does beside torch's ops), with on-disk caching where a cache location exists, else
    without: a read-only install must still run (numba refuses `cache=True` there at decoration
    time)."""
    options.setdefault("nogil", True)

    def compile_it(fn):
        try:
            return numba.njit(cache=True, **options)(fn)
        except RuntimeError:  # "cannot cache function ...: no locator available"
            return numba.njit(cache=False, **options)(fn)
    return compile_it


def bits_view(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor -> a numpy array of the same memory: its own values for float32, its
    uint16 bits for bfloat16 (tests and tools; the kernels take `address`)."""
    return t.view(torch.uint16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def address(t: torch.Tensor) -> int:
    """A contiguous CPU tensor -> the address of its first element, for a kernel."""
    return t.data_ptr()


@intrinsic
def _pointer(typingctx, addr):
    """An integer address -> a void pointer numba.carray accepts."""
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)
    return types.voidptr(addr), codegen


@numba.njit(inline="always")
def u16_at(addr, shape):
    """The uint16 array (bfloat16 bits) of `shape` (a tuple) at addr, C order."""
    return numba.carray(_pointer(addr), shape, np.uint16)


@numba.njit(inline="always")
def f32_at(addr, shape):
    """The float32 array of `shape` (a tuple) at addr, C order."""
    return numba.carray(_pointer(addr), shape, np.float32)


@numba.njit(inline="always")
def i64_at(addr, shape):
    """The int64 array of `shape` (a tuple) at addr, C order."""
    return numba.carray(_pointer(addr), shape, np.int64)


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
