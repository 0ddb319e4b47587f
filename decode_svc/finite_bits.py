"""Are all values of a K or V payload finite, read from its little-endian bytes?

An IEEE value is NaN or infinite exactly when its exponent bits are all ones, that is when its
bits without the sign are at least the exponent mask E. Read as a signed integer, a value with
the sign bit clear is its bits, so it is non-finite exactly when that integer is >= E (values
with the sign set are negative there); read as an unsigned integer, a value with the sign bit
set is non-finite exactly when that integer is >= sign | E (values with it clear are below
the sign bit). So a block is all finite exactly when its signed max is < E and its unsigned max
is < sign | E: two max reductions over the same bytes, no temporary and no float conversion
(0.045 s/GB on a 128 KiB bf16 block in cache, against 0.065 for the masked max it replaces and
~1.5 for `torch.isfinite(t).all()`; bench/payload_pass.py). Same answer as
`torch.isfinite(t).all()` (tests/unit/test_finite_bits.py), for the dtypes the wire carries.
"""

from __future__ import annotations

import numpy as np
import torch

# dtype -> (signed and unsigned integer of its width, exponent mask, sign bit)
_BITS: dict[torch.dtype, tuple[type, type, int, int]] = {
    torch.float32: (np.int32, np.uint32, 0x7F800000, 0x80000000),
    torch.float16: (np.int16, np.uint16, 0x7C00, 0x8000),
    torch.bfloat16: (np.int16, np.uint16, 0x7F80, 0x8000),
}


# Values per reduction: a block that stays in cache between the two maxes.
BLOCK_VALUES = 1 << 17


def value_width(dtype: torch.dtype) -> int:
    """Bytes per value of dtype (blocks of the byte passes are cut at multiples of it)."""
    return np.dtype(_BITS[dtype][1]).itemsize


def block_is_finite(part: np.ndarray, dtype: torch.dtype) -> bool:
    """part: uint8 array of whole values of dtype (read only, non-empty) -> all finite (the
    two maxes of the module docstring)."""
    signed, unsigned, exponent, sign = _BITS[dtype]
    return bool(part.view(signed).max() < exponent) and bool(
        part.view(unsigned).max() < (sign | exponent))


def all_finite_bytes(data: np.ndarray, dtype: torch.dtype) -> bool:
    """data: uint8 array holding whole values of dtype (read only, any size) -> all finite."""
    return all_finite_pieces((data,), dtype)


def all_finite_pieces(pieces, dtype: torch.dtype) -> bool:
    """pieces: uint8 arrays, each holding whole values of dtype -> all finite (a chunk landed
    in pages comes as one piece per run of slots)."""
    block = BLOCK_VALUES * value_width(dtype)
    for data in pieces:
        for start in range(0, data.size, block):
            part = data[start:start + block]
            if part.size and not block_is_finite(part, dtype):
                return False
    return True
