"""Are all values of a K or V payload finite, read from its little-endian bytes?

An IEEE value is NaN or infinite exactly when its exponent bits are all ones, that is when its
bits without the sign are at least the exponent mask. Checking that on the bytes decode landed
costs one masked max over the payload (numpy, no float conversion); `torch.isfinite` on bf16
costs 25x more on the CPU. Same answer as `torch.isfinite(t).all()` (tests/unit/
test_finite_bits.py), for the dtypes the wire carries.
"""

from __future__ import annotations

import numpy as np
import torch

# dtype -> (unsigned integer of its width, bits without the sign, exponent mask)
_BITS: dict[torch.dtype, tuple[type, int, int]] = {
    torch.float32: (np.uint32, 0x7FFFFFFF, 0x7F800000),
    torch.float16: (np.uint16, 0x7FFF, 0x7C00),
    torch.bfloat16: (np.uint16, 0x7FFF, 0x7F80),
}


# Values masked per pass: one scratch block that stays in cache (a payload-sized temporary
# would be page-faulted in anew for every chunk; measured 2x slower at 4 MiB chunks).
BLOCK_VALUES = 1 << 17


def finite_masks(dtype: torch.dtype) -> tuple[type, int, int]:
    """dtype -> (unsigned integer of its width, bits without the sign, exponent mask); a value
    is finite exactly when (its bits & the second) < the third."""
    return _BITS[dtype]


def all_finite_bytes(data: np.ndarray, dtype: torch.dtype) -> bool:
    """data: uint8 array holding whole values of dtype (read only, any size) -> all finite."""
    return all_finite_pieces((data,), dtype)


def all_finite_pieces(pieces, dtype: torch.dtype) -> bool:
    """pieces: uint8 arrays, each holding whole values of dtype -> all finite (one scratch
    block for all of them: a chunk landed in pages comes as one piece per run of slots)."""
    word, magnitude, exponent = _BITS[dtype]
    scratch = np.empty(BLOCK_VALUES, word)
    for data in pieces:
        values = data.view(word)
        for start in range(0, values.size, BLOCK_VALUES):
            part = values[start:start + BLOCK_VALUES]
            if not part.size:
                continue
            masked = scratch[:part.size]
            np.bitwise_and(part, word(magnitude), out=masked)
            if masked.max() >= exponent:
                return False
    return True
