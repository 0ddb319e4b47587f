"""One pass over a chunk's payload for both of decode's byte checks: the CRC-32C of K || V (the
chunk's `crc32c`, common.handoff.crc) and the finiteness of every value (decode_svc.finite_bits),
block by block, so the second check reads each block from cache where two separate passes read
the whole chunk from memory twice.

Invariants: the result is exactly (payload_crc32c(k, v), all_finite_pieces(k and v pieces,
dtype)) for any payload and any block size (tests/unit/test_payload_pass.py); the CRC always
covers every byte (a non-finite value stops only the finiteness test, never the checksum);
nothing is written except one scratch block of decode's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.handoff.crc import ChecksummedBytes, crc32c_extend
from common.handoff.scattered import ScatteredBytes
from decode_svc.finite_bits import block_is_finite, value_width

# Bytes per block: measured best of 64 KiB .. 1 MiB on this project's hosts
# (bench/payload_pass.py); small enough to stay in L2 between the two checks.
DEFAULT_BLOCK_BYTES = 128 << 10


@dataclass(frozen=True)
class PayloadCheck:
    k_crc32c: int  # CRC-32C of K alone (where V's extension starts)
    crc32c: int  # CRC-32C of K || V
    finite: bool  # every value of K and V is finite


def _pieces(data) -> tuple:
    return data.pieces if isinstance(data, ScatteredBytes) else (data,)


def check_payload(k, v, dtype: torch.dtype, block_bytes: int = DEFAULT_BLOCK_BYTES
                  ) -> PayloadCheck:
    """k, v: uint8 arrays or ScatteredBytes, each piece holding whole values of dtype ->
    their CRC-32C (K then V) and finiteness, from one read of each block."""
    return block_pass(((None, _pieces(k)), (None, _pieces(v))), dtype, block_bytes)


def block_pass(sides, dtype: torch.dtype, block_bytes: int = DEFAULT_BLOCK_BYTES
               ) -> PayloadCheck:
    """sides: (K's, V's) (fill or None, uint8 pieces of whole values of dtype). Block by block
    of each side's pieces in order, fill(at, part) first writes the source's bytes [at, at +
    len(part)) into part (at counts from the side's first byte; a fill that cannot raises), then
    the block's CRC-32C and finiteness are computed while it is in cache. The CRC covers every
    byte whatever the finiteness answer."""
    width = value_width(dtype)
    block = max(width, block_bytes - block_bytes % width)
    crc, finite, k_crc = 0, True, 0
    for side, (fill, pieces) in enumerate(sides):
        if side == 1:
            k_crc = crc
        at = 0
        for data in pieces:
            for start in range(0, data.size, block):
                part = data[start:start + block]  # [<= block] uint8
                if fill is not None:
                    fill(at, part)
                    at += part.size
                crc = crc32c_extend(crc, part)
                if finite and part.size:
                    finite = block_is_finite(part, dtype)
    return PayloadCheck(k_crc, crc, finite)


def checksummed(k: ScatteredBytes, v: ScatteredBytes, check: PayloadCheck
                ) -> tuple[ChecksummedBytes, ChecksummedBytes]:
    """k and v carrying the CRC-32C the pass computed over them, for the verifier's
    payload_crc32c(k, v) (common.handoff.crc.ChecksummedBytes)."""
    return (ChecksummedBytes(k.pieces, k.nbytes, 0, check.k_crc32c),
            ChecksummedBytes(v.pieces, v.nbytes, check.k_crc32c, check.crc32c))
