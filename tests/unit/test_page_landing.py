"""decode_svc.page_landing: the views of a chunk's page slots are exactly where the engine's own
write path puts those tokens (shuffled page tables, odd ranges, page-crossing runs), and a scatter
read through them lands the region's bytes there."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from common.handoff.crc import crc32c_extend, payload_crc32c
from common.handoff.shm_region import IOV_MAX, RegionReader, RegionWriter
from common.kernels.pack_kv import unpack_kv_bytes_cpu
from common.kvpool.kv_cache import KvPool, PoolConfig
from decode_svc.finite_bits import all_finite_bytes, all_finite_pieces
from decode_svc.page_landing import PageLanding

LAYERS, HEADS, DIM, PAGE = 2, 2, 4, 4


def _pool(tokens: int, owner: str, shuffle: bool) -> KvPool:
    pool = KvPool(PoolConfig(pool_tokens=64 * PAGE, page_size=PAGE), LAYERS, HEADS, DIM,
                  torch.float16, torch.device("cpu"))
    if shuffle:  # take pages out of order: hold some, free every other one
        pool.allocator.allocate("spacer", 40 * PAGE)
        random.Random(0).shuffle(pool.allocator._free)
    pool.allocator.allocate(owner, tokens)
    return pool


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("start,end", [(0, 1), (3, 9), (0, 17), (5, 22)])
def test_views_are_the_slots_the_write_path_fills(shuffle, start, end):
    pool = _pool(24, "r", shuffle)
    landing = PageLanding(pool)
    row = HEADS * DIM * 2
    data = np.random.default_rng(1).integers(0, 256, (2, (end - start) * row), dtype=np.uint8)
    table = pool.allocator.page_table("r")
    reference = pool.k.clone(), pool.v.clone()
    unpack_kv_bytes_cpu(data[0], data[1], reference[0][1], reference[1][1], table, start,
                        end - start)
    pieces = landing.pieces("r", 1, start, end)
    k, v = pieces.k, pieces.v
    assert len(k) == len(v) == data.shape[1]
    for pieces, payload in ((k, data[0]), (v, data[1])):
        at = 0
        for piece in pieces.pieces:
            piece[:] = payload[at:at + piece.size]
            at += piece.size
    for got, want in ((pool.k, reference[0]), (pool.v, reference[1])):  # bytes: NaNs too
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert payload_crc32c(k, v) == crc32c_extend(crc32c_extend(0, data[0]), data[1])
    if not shuffle:  # a fresh reservation's pages are adjacent: one piece each
        assert len(k.pieces) == 1


def test_a_range_past_the_reservation_is_refused_before_any_view():
    pool = _pool(8, "r", False)
    landing = PageLanding(pool)
    assert not landing.in_range(LAYERS, 0, 1, 8) and not landing.in_range(0, 4, 4, 8)
    assert not landing.in_range(0, 0, 9, 8) and landing.in_range(0, 0, 8, 8)
    with pytest.raises(ValueError):
        landing.pieces("r", 0, 0, 9)


def test_scatter_read_fills_more_pieces_than_one_preadv_takes(tmp_path):
    writer = RegionWriter(str(tmp_path), 3 * IOV_MAX)
    source = np.random.default_rng(2).integers(0, 256, 3 * IOV_MAX, dtype=np.uint8)
    writer.write(0, source)
    reader = RegionReader(str(tmp_path), writer.name)
    out = np.zeros(3 * IOV_MAX, dtype=np.uint8)
    reader.scatter_into(0, [out[i:i + 2] for i in range(0, out.size, 2)])  # 1.5 x IOV_MAX
    assert np.array_equal(out, source)
    reader.close()
    writer.close()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_finiteness_over_pieces_is_that_of_their_concatenation(dtype):
    values = torch.randn(3000).to(dtype)
    values[2345] = float("inf")
    flat = values.view(torch.uint8).numpy()
    size = values.element_size()
    cut = [0, 7 * size, 1000 * size, flat.size]
    pieces = [flat[a:b] for a, b in zip(cut, cut[1:])]
    assert not all_finite_pieces(pieces, dtype) and not all_finite_bytes(flat, dtype)
    assert all_finite_pieces(pieces[:2], dtype) == bool(torch.isfinite(values[:1000]).all())
