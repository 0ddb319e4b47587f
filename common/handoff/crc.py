"""CRC-32C of a chunk's payload (K then V): the one definition both sides use, on the frame's
own bytes and on decode's copy.

The `crc32c` package (SSE4.2 / ARMv8 instructions, GIL released on large buffers) computes it
about 3x faster than `google_crc32c`'s C build on this project's hosts; both give the same value
(tests/unit/test_payload_crc.py), and `google_crc32c` is used when `crc32c` is not installed.
Either reads any C-contiguous buffer (bytes, memoryview, uint8 numpy arrays) without copying.
"""

from __future__ import annotations

import google_crc32c
import numpy as np

from common.handoff.scattered import ScatteredBytes

try:
    import crc32c as _hw
except ImportError:  # pragma: no cover - the fallback keeps every check, only slower
    _hw = None


def crc32c_extend(value: int, data) -> int:
    """CRC-32C of (whatever gave `value`) || data; value 0 starts a new checksum. data may be
    ScatteredBytes (its pieces in order)."""
    if isinstance(data, ScatteredBytes):
        for piece in data.pieces:
            value = crc32c_extend(value, piece)
        return value
    if _hw is not None:
        return _hw.crc32c(data, value)
    if isinstance(data, memoryview):  # google_crc32c takes bytes and arrays, not memoryviews
        data = np.frombuffer(data, dtype=np.uint8)
    return google_crc32c.extend(value, data)


def payload_crc32c(k, v) -> int:
    """CRC-32C of k || v (a chunk's `crc32c` field), each read once, in place."""
    return crc32c_extend(crc32c_extend(0, k), v)
