"""The shared-memory receiver's landing (decode_svc.shm_receiver: inline_landing.land_blocks with
one pread per block from the region): over shuffled page tables and blocks smaller than a
chunk, what lands is the region's bytes, and the pass answers exactly the two separate checks
over the pages (CRC-32C of K || V, finiteness) wherever a non-finite value lies; a region that
ends inside the chunk raises RegionError (refused as REGION_INVALID) instead of answering."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from common.handoff.crc import payload_crc32c
from common.handoff.shm_region import RegionError, RegionReader, RegionWriter
from common.kvpool.kv_cache import KvPool, PoolConfig
from decode_svc.finite_bits import all_finite_pieces
from decode_svc.inline_landing import land_blocks
from decode_svc.page_landing import PageLanding
from decode_svc.payload_pass import check_payload
from decode_svc.shm_receiver import _region_fill

LAYERS, HEADS, DIM, PAGE, TOKENS = 2, 2, 8, 4, 30


def _pool(dtype: torch.dtype) -> KvPool:
    pool = KvPool(PoolConfig(pool_tokens=64 * PAGE, page_size=PAGE), LAYERS, HEADS, DIM, dtype,
                  torch.device("cpu"))
    pool.allocator.allocate("spacer", 40 * PAGE)
    random.Random(0).shuffle(pool.allocator._free)  # take pages out of order
    pool.allocator.allocate("r", TOKENS)
    return pool


def _region(tmp_path, data: bytes, size: int | None = None) -> tuple[RegionWriter, RegionReader]:
    writer = RegionWriter(str(tmp_path), len(data) if size is None else size)
    writer.write(0, np.frombuffer(data, np.uint8)[:writer.size])
    return writer, RegionReader(str(tmp_path), writer.name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [4, 96, 128 << 10])
@pytest.mark.parametrize("poison", [None, "k_first", "v_last"])
def test_lands_the_region_bytes_with_both_checks(tmp_path, dtype, block, poison):
    start, end = 3, 27  # crosses pages at both ends
    kv = torch.randn(2, end - start, HEADS, DIM).to(dtype)  # [2, n, Hkv, D]
    if poison == "k_first":
        kv[0, 0, 0, 0] = float("nan")
    elif poison == "v_last":
        kv[1, -1, -1, -1] = float("inf")
    flat = kv.view(torch.uint8).numpy().reshape(2, -1)  # [2, side bytes]
    prefix = 40  # the chunk's K does not start at the region's first byte
    writer, reader = _region(tmp_path, bytes(prefix) + flat.tobytes())
    try:
        pool = _pool(dtype)
        pieces = PageLanding(pool).pieces("r", 1, start, end)
        side = flat.shape[1]
        check = land_blocks(_region_fill(reader, prefix), _region_fill(reader, prefix + side),
                            pieces.k, pieces.v, dtype, block)
        landed = [np.concatenate(p.pieces) for p in (pieces.k, pieces.v)]
        assert np.array_equal(landed[0], flat[0]) and np.array_equal(landed[1], flat[1])
        assert check == check_payload(pieces.k, pieces.v, dtype)
        assert check.crc32c == payload_crc32c(flat[0], flat[1])
        assert check.k_crc32c == payload_crc32c(flat[0], np.empty(0, np.uint8))
        assert check.finite is all_finite_pieces(pieces.k.pieces + pieces.v.pieces, dtype)
        assert check.finite is (poison is None)
    finally:
        reader.close()
        writer.close()


def test_a_region_that_ends_inside_the_chunk_raises(tmp_path):
    kv = torch.randn(2, 8, HEADS, DIM).to(torch.bfloat16)  # [2, n, Hkv, D]
    flat = kv.view(torch.uint8).numpy().reshape(2, -1)
    side = flat.shape[1]
    writer, reader = _region(tmp_path, flat.tobytes(), size=side + side // 2)  # V cut in half
    try:
        pieces = PageLanding(_pool(torch.bfloat16)).pieces("r", 0, 0, 8)
        with pytest.raises(RegionError, match="ends before"):
            land_blocks(_region_fill(reader, 0), _region_fill(reader, side), pieces.k, pieces.v,
                        torch.bfloat16, 64)
    finally:
        reader.close()
        writer.close()
