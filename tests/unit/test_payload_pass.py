"""decode_svc.payload_pass: one block-interleaved pass gives exactly the two separate checks
(the verifier's CRC-32C of K || V, the engine's finiteness of every value), whatever the dtype,
the block size, the split into pieces, and wherever a NaN, an infinity, -0.0 or a subnormal
lies relative to a block's edge; and the CRC it hands the verifier is the one the bytes have."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.handoff.crc import ChecksummedBytes, crc32c_extend, payload_crc32c
from common.handoff.scattered import ScatteredBytes
from decode_svc.finite_bits import all_finite_pieces
from decode_svc.payload_pass import check_payload, checksummed

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BLOCKS = [4, 96, 64 << 10, 128 << 10]


def _specials(dtype: torch.dtype) -> dict[str, float]:
    info = torch.finfo(dtype)
    return {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "-0.0": -0.0,
            "subnormal": info.smallest_normal / 2, "-subnormal": -info.smallest_normal / 4,
            "max": info.max}


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy().reshape(-1)


def _split(data: np.ndarray, cuts: list[int]) -> ScatteredBytes:
    edges = [0, *sorted(set(cuts)), data.size]
    pieces = tuple(data[a:b] for a, b in zip(edges, edges[1:]) if b > a)
    return ScatteredBytes(pieces, data.size)


def _both_checks(k: ScatteredBytes, v: ScatteredBytes, dtype) -> tuple[int, bool]:
    return payload_crc32c(k, v), all_finite_pieces(k.pieces + v.pieces, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("special", ["nan", "inf", "-inf", "-0.0", "subnormal", "-subnormal",
                                     "max", None])
def test_one_pass_equals_the_two_checks_at_block_edges(dtype, block, special):
    gen = torch.Generator().manual_seed(7)
    values = 70_000  # > 2 blocks of 64 KiB for every width
    width = torch.empty(0, dtype=dtype).element_size()
    block_values = block // width
    k = torch.randn(values, generator=gen).to(dtype)  # [values]
    v = torch.randn(values, generator=gen).to(dtype)  # [values]
    places = sorted({0, block_values - 1, block_values, 2 * block_values - 1, values - 1}
                    & set(range(values)))
    for place in places:
        kk, vv = k.clone(), v.clone()
        if special is not None:
            (kk if place % 2 else vv)[place] = _specials(dtype)[special]
        kb, vb = _bytes(kk), _bytes(vv)
        cuts = [width * block_values + width, width * 3]  # piece edges off the block edges
        ks, vs = _split(kb, cuts), _split(vb, cuts[:1])
        crc, finite = _both_checks(ks, vs, dtype)
        got = check_payload(ks, vs, dtype, block)
        assert (got.crc32c, got.finite) == (crc, finite), (place, special)
        assert got.k_crc32c == crc32c_extend(0, kb)
        assert got.finite == bool(torch.isfinite(kk).all() and torch.isfinite(vv).all())
        assert got.finite == (special not in ("nan", "inf", "-inf"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_random_bit_patterns_and_plain_arrays(dtype):
    rng = np.random.default_rng(3)
    for size in (2, 4, 4096, 300_004):
        size -= size % 4
        k = rng.integers(0, 256, size, dtype=np.uint8)
        v = rng.integers(0, 256, size, dtype=np.uint8)
        expected = (payload_crc32c(k, v), all_finite_pieces((k, v), dtype))
        for block in (4, 4100, 128 << 10):
            got = check_payload(k, v, dtype, block)
            assert (got.crc32c, got.finite) == expected, (size, block)


def test_the_checksummed_pair_gives_the_verifier_the_bytes_own_crc():
    rng = np.random.default_rng(5)
    k = _split(rng.integers(0, 256, 10_000, dtype=np.uint8), [1000, 5000])
    v = _split(rng.integers(0, 256, 10_000, dtype=np.uint8), [2])
    check = check_payload(k, v, torch.bfloat16)
    ck, cv = checksummed(k, v, check)
    assert payload_crc32c(ck, cv) == payload_crc32c(k, v) == check.crc32c
    # started from another value, the memo does not apply: the bytes are read again
    assert crc32c_extend(1, cv) == crc32c_extend(1, v) != check.crc32c
    stale = ChecksummedBytes(v.pieces, v.nbytes, 0, 0xDEADBEEF)
    assert crc32c_extend(12345, stale) == crc32c_extend(12345, v)
