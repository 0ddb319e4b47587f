"""decode_svc.inline_landing: the one pass that lands an inline chunk in the pages writes exactly
what the engine's write path writes (shuffled page tables, page-crossing runs, any block size),
answers exactly the two separate checks over those pages (CRC-32C of K || V, finiteness) wherever
a non-finite value lies, and the hooks land only a chunk the verifier could accept: another
request's, an out-of-range or a wrongly sized chunk reaches the verifier untouched, nothing
written; a tampered payload lands but carries the CRC of the tampered bytes (refused)."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
import torch

from common.handoff.codec import chunk_wire, parse_chunk_fast
from common.handoff.crc import payload_crc32c
from common.handoff.layout import KvLayout
from common.handoff.scattered import ScatteredBytes
from common.handoff.verifier import Expectation, VerifiedChunk
from common.kernels.pack_kv import unpack_kv_bytes_cpu
from common.kvpool.kv_cache import KvPool, PoolConfig
from decode_svc.finite_bits import all_finite_pieces
from decode_svc.inline_landing import InlineLanding, land_payload
from decode_svc.page_landing import PageLanding

LAYERS, HEADS, DIM, PAGE, TOKENS = 2, 2, 8, 4, 30


def _pool(dtype: torch.dtype, shuffle: bool) -> KvPool:
    pool = KvPool(PoolConfig(pool_tokens=64 * PAGE, page_size=PAGE), LAYERS, HEADS, DIM, dtype,
                  torch.device("cpu"))
    if shuffle:  # take pages out of order
        pool.allocator.allocate("spacer", 40 * PAGE)
        random.Random(0).shuffle(pool.allocator._free)
    pool.allocator.allocate("r", TOKENS)
    return pool


def _payload(dtype: torch.dtype, tokens: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, tokens, HEADS, DIM, generator=gen).to(dtype)  # [2, n, Hkv, D]
    flat = kv.view(torch.uint8).numpy().reshape(2, -1)
    return flat[0], flat[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("block", [4, 96, 128 << 10])
@pytest.mark.parametrize("poison", [None, 0, "edge", "last"])
def test_lands_what_the_write_path_writes_with_both_checks(dtype, shuffle, block, poison):
    start, end = 3, 27  # crosses pages at both ends
    pool, reference = _pool(dtype, shuffle), _pool(dtype, shuffle)
    k, v = _payload(dtype, end - start, seed=5)
    width = torch.empty(0, dtype=dtype).element_size()
    if poison is not None:
        v = v.copy()
        at = {0: 0, "edge": block - block % width, "last": v.size - width}[poison]
        at = min(at, v.size - width)
        v.view(np.uint8)[at:at + width] = np.frombuffer(
            torch.tensor([float("nan")], dtype=dtype).view(torch.uint8).numpy(), np.uint8)
    pieces = PageLanding(pool).pieces("r", 1, start, end)
    check = land_payload(k, v, pieces.k, pieces.v, dtype, block_bytes=block)
    unpack_kv_bytes_cpu(k, v, reference.k[1], reference.v[1],
                        reference.allocator.page_table("r"), start, end - start)
    assert torch.equal(pool.k.view(torch.uint8), reference.k.view(torch.uint8))
    assert torch.equal(pool.v.view(torch.uint8), reference.v.view(torch.uint8))
    assert check.crc32c == payload_crc32c(pieces.k, pieces.v) == payload_crc32c(k, v)
    assert check.k_crc32c == payload_crc32c(k, np.empty(0, np.uint8))
    assert check.finite is all_finite_pieces(pieces.k.pieces + pieces.v.pieces, dtype)
    assert check.finite is (poison is None)


class _Engine:
    def __init__(self) -> None:
        self.landed_calls: list[tuple[str, tuple]] = []
        self.writes: list[VerifiedChunk] = []

    def landed(self, request_id: str, pieces: tuple) -> None:
        self.landed_calls.append((request_id, pieces))


def _landing(dtype: torch.dtype = torch.bfloat16):
    pool = _pool(dtype, shuffle=True)
    layout = KvLayout(LAYERS, HEADS, DIM, dtype)
    expect = Expectation("r", TOKENS, layout, "fp", 1 << 20, 16, b"n" * 16, b"")
    engine = _Engine()
    landing = InlineLanding(expect, engine, PageLanding(pool), lambda frame: frame,
                            lambda eng, request_id, chunk: eng.writes.append(chunk))
    return pool, engine, landing


def _frame(request_id: str, layer: int, start: int, kv: torch.Tensor) -> bytes:
    return chunk_wire(request_id, 0, layer, start, kv, b"n" * 16)


def test_a_chunk_lands_and_carries_the_crc_of_the_landed_bytes():
    pool, engine, landing = _landing()
    kv = torch.randn(2, 9, HEADS, DIM).to(torch.bfloat16)  # [2, n, Hkv, D]
    frame = landing.resolve(parse_chunk_fast(_frame("r", 1, 4, kv)))
    chunk = frame.chunk
    assert isinstance(chunk.k, ScatteredBytes)
    assert payload_crc32c(chunk.k, chunk.v) == chunk.crc32c
    landed = torch.cat([torch.from_numpy(p.copy()) for p in chunk.k.pieces])
    assert torch.equal(landed, kv[0].contiguous().view(torch.uint8).reshape(-1))
    landing.deliver(VerifiedChunk(1, 4, 13, chunk.k, chunk.v))
    assert engine.landed_calls == []  # every value finite: nothing left for the engine


def test_a_tampered_payload_carries_the_crc_of_what_landed():
    _, engine, landing = _landing()
    kv = torch.randn(2, 8, HEADS, DIM).to(torch.bfloat16)  # [2, n, Hkv, D]
    data = bytearray(_frame("r", 0, 0, kv))
    data[-200] ^= 0x01  # inside V
    chunk = landing.resolve(parse_chunk_fast(bytes(data))).chunk
    assert payload_crc32c(chunk.k, chunk.v) != chunk.crc32c  # CHECKSUM_MISMATCH


def test_a_non_finite_chunk_leaves_its_pieces_to_the_engines_check():
    _, engine, landing = _landing()
    kv = torch.randn(2, 8, HEADS, DIM).to(torch.bfloat16)  # [2, n, Hkv, D]
    kv[1, 3, 0, 2] = float("inf")
    chunk = landing.resolve(parse_chunk_fast(_frame("r", 0, 8, kv))).chunk
    landing.deliver(VerifiedChunk(0, 8, 16, chunk.k, chunk.v))
    (request_id, pieces), = engine.landed_calls
    assert pieces == chunk.k.pieces + chunk.v.pieces
    assert not all_finite_pieces(pieces, torch.bfloat16)


@pytest.mark.parametrize("case", ["other_request", "layer_out_of_range", "past_the_prompt",
                                  "short_k"])
def test_what_the_verifier_refuses_is_not_landed(case):
    pool, engine, landing = _landing()
    before = (pool.k.clone(), pool.v.clone())
    kv = torch.randn(2, 6, HEADS, DIM).to(torch.bfloat16)  # [2, n, Hkv, D]
    request_id, layer, start = "r", 0, 0
    if case == "other_request":
        request_id = "other"
    elif case == "layer_out_of_range":
        layer = LAYERS
    elif case == "past_the_prompt":
        start = TOKENS - 3
    parsed = parse_chunk_fast(_frame(request_id, layer, start, kv))
    if case == "short_k":
        parsed = type(parsed)(replace(parsed.chunk, k=parsed.chunk.k[:-2]))
    frame = landing.resolve(parsed)
    assert frame is parsed  # untouched: the verifier sees (and refuses) the frame as sent
    assert torch.equal(pool.k, before[0]) and torch.equal(pool.v, before[1])
    assert engine.landed_calls == []
