"""The payload checksum helper gives google_crc32c's CRC-32C, whichever library computes it."""

from __future__ import annotations

import google_crc32c
import numpy as np
import pytest

import common.handoff.crc as crc


def _reference(k: bytes, v: bytes) -> int:
    return google_crc32c.value(k + v)


@pytest.mark.parametrize("library", ["installed", "fallback"])
def test_payload_crc_is_crc32c_of_k_then_v(library, monkeypatch):
    if library == "fallback":
        monkeypatch.setattr(crc, "_hw", None)
    elif crc._hw is None:
        pytest.skip("the crc32c package is not installed")
    rng = np.random.default_rng(0)
    for size in (0, 1, 7, 4096, (1 << 20) + 3):
        k = rng.integers(0, 256, size, dtype=np.uint8)
        v = rng.integers(0, 256, size, dtype=np.uint8)
        ro_k = np.frombuffer(k.tobytes(), np.uint8)  # read-only views, as decode holds them
        want = _reference(k.tobytes(), v.tobytes())
        assert crc.payload_crc32c(ro_k, v) == want
        assert crc.payload_crc32c(k.tobytes(), memoryview(v.tobytes())) == want
    assert crc.payload_crc32c(b"ab", b"c") != crc.payload_crc32c(b"a", b"bd")
