"""CRC-32C of a chunk's payload (K then V): the one definition both sides use, on the frame's
own bytes and on decode's copy.

The `crc32c` package (SSE4.2 / ARMv8 instructions, GIL released on large buffers) computes it
about 3x faster than `google_crc32c`'s C build on this project's hosts; both give the same value
(tests/unit/test_payload_crc.py), and `google_crc32c` is used when `crc32c` is not installed.
Either reads any C-contiguous buffer (bytes, memoryview, uint8 numpy arrays) without copying.
"""

from __future__ import annotations

from dataclasses import dataclass

import google_crc32c
import numpy as np

from common.handoff.scattered import ScatteredBytes

try:
    import crc32c as _hw
except ImportError:  # pragma: no cover - the fallback keeps every check, only slower
    _hw = None


@dataclass(frozen=True)
class ChecksummedBytes(ScatteredBytes):
    """ScatteredBytes whose CRC-32C extension decode already computed over these very bytes, in
    the same pass as its other check (decode_svc.payload_pass): crc32c_extend(crc_before, self)
    is crc_after, answered without reading them again.

    Invariant: only decode makes one, over bytes in its own memory that nothing writes between
    the pass and the verifier's use of the value (the pages of a reservation, landed by the
    shared-memory receiver just before the verifier sees the frame, on the same thread)."""

    crc_before: int = 0
    crc_after: int = 0


def crc32c_extend(value: int, data) -> int:
    """CRC-32C of (whatever gave `value`) || data; value 0 starts a new checksum. data may be
    ScatteredBytes (its pieces in order)."""
    if isinstance(data, ChecksummedBytes) and value == data.crc_before:
        return data.crc_after
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
