"""SPEC P-68a: while a handoff's pages are registered for the peer, no slot of them holds another
request's KV. The pool is not cleared on free here (no poison, no scrub), and an earlier
request's KV (a marker) is planted in every page first; a handoff whose first chunk registered
all of its slots while only layer 0 of its first pass was stored is then READ by a second agent
(decode's role) at slots not written yet: later layers, a chunked prefill's later pass. They
come back zero, never the marker; a cached prefix page the handoff borrows keeps its KV (it is
this scope's own prefix, lent to other requests too). The lease counter counts a handoff only
once it is really served from the pages, not when it falls back to the packed buffer."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from common.counters import Counters
from common.handoff.binding import new_nonce
from common.handoff.layout import KvLayout
from common.handoff.nixl_agent import DONE, open_agent
from common.kvpool.kv_cache import KvPool, PoolConfig
from common.ops.torch_ops import TorchOps
from common.pb.kvhandoff.v1 import handoff_pb2
from prefill_svc.nixl_pages_sender import NixlPagesSender
from prefill_svc.nixl_sender import NixlPlane
from prefill_svc.page_lease import LeaseBudget, PageLeaseConfig
from tests.planes.nixl_env import nixl_or_skip

LAYOUT = KvLayout(3, 2, 16, torch.float32)
PAGE = 16
TOKENS = 40  # 3 pages of 16
MARK = 7.0  # an earlier request's KV, left in freed pages
OWN = 1.0  # this request's KV
PREFIX = 2.0  # the cached prefix's KV (this scope's, complete in every layer)


@pytest.fixture(scope="module")
def plane():
    p = NixlPlane(nixl_or_skip())
    yield p
    p.close()


@pytest.fixture(scope="module")
def reader():
    agent, why = open_agent("decode", loopback=True)
    if agent is None:
        pytest.skip(why)
    return agent


@pytest.fixture
def pool():
    p = KvPool(PoolConfig(256, PAGE), 3, 2, 16, torch.float32, torch.device("cpu"))
    p.k.fill_(MARK)
    p.v.fill_(MARK)
    return p


def _sender(plane, pool, counters: Counters, request_id: str = "r") -> NixlPagesSender:
    budget = LeaseBudget(PageLeaseConfig(), pool.allocator.num_pages, counters)
    assert budget.take(pool.allocator.pages_needed(TOKENS))
    return NixlPagesSender(request_id, LAYOUT, TOKENS, plane, pool, budget, lambda _: None,
                           counters, 4 << 20)


def _store_layer0(pool: KvPool, table: list[int], start: int, end: int) -> None:
    """What the engine's first pass has stored when it emits layer 0: tokens [start, end)."""
    for token in range(start, end):
        page, offset = table[token // PAGE], token % PAGE
        pool.k[0, page, offset] = OWN
        pool.v[0, page, offset] = OWN


def _first_chunk(sender, pool, table, first_end: int):
    """The engine's first spans/pack/chunk (layer 0 of the first pass) -> the chunk's ref."""
    rows = torch.tensor(table, dtype=torch.int32)
    start, count = sender.spans(rows, 0, first_end, PAGE)[0]
    kv = sender.pack(TorchOps(), pool.k[0], pool.v[0], rows, start, count)
    frame = sender.chunk("r", 0, 0, start, kv, new_nonce())
    return handoff_pb2.PrefillResponse.FromString(frame).chunk.ref


def _read(reader, plane, metadata: bytes, address: int, length: int) -> np.ndarray:
    """decode's READ of prefill's [address, +length) -> the bytes as float32."""
    peer = reader.add_remote(metadata)
    local = np.zeros(length, dtype=np.uint8)
    reg = reader.register(local, share=False)
    try:
        handle, state = reader.read(local, [(address, length)], peer)
        deadline = time.monotonic() + 10
        while state != DONE and time.monotonic() < deadline:
            plane.agent.progress()
            state = reader.state(handle)
        assert state == DONE, state
        reader.release(handle)
    finally:
        reader.deregister(reg)
    return local.view(np.float32)


def _slot(pool: KvPool, cache: torch.Tensor, layer: int, table: list[int], token: int,
          count: int) -> tuple[int, int]:
    page, offset = table[token // PAGE], token % PAGE
    piece = cache[layer, page, offset:offset + count]
    return piece.data_ptr(), piece.nbytes


@pytest.mark.parametrize("first_end", [TOKENS, PAGE])  # one pass; a chunked prefill's first
def test_slots_not_written_yet_read_zero_not_an_earlier_requests_kv(plane, reader, pool,
                                                                    first_end):
    counters = Counters()
    table = pool.allocator.allocate("r", TOKENS)
    _store_layer0(pool, table, 0, first_end)
    sender = _sender(plane, pool, counters)
    ref = _first_chunk(sender, pool, table, first_end)
    assert sender.fallback is None and ref.nixl_buffer_metadata
    later_layer = _read(reader, plane, ref.nixl_buffer_metadata,
                        *_slot(pool, pool.v, 2, table, 0, PAGE))
    assert not (later_layer == MARK).any() and (later_layer == 0).all()
    if first_end < TOKENS:  # layer 0 of the second pass: not stored yet
        later_pass = _read(reader, plane, ref.nixl_buffer_metadata,
                           *_slot(pool, pool.k, 0, table, first_end, PAGE))
        assert (later_pass == 0).all()
    stored = _read(reader, plane, ref.nixl_buffer_metadata,
                   *_slot(pool, pool.k, 0, table, 0, PAGE))
    assert (stored == OWN).all()  # what layer 0 of the first pass stored is left alone
    for layer in range(LAYOUT.num_layers):  # every registered slot: zeros or this request's
        for cache in (pool.k, pool.v):
            rows = cache[layer].reshape(-1, 2, 16)[pool.slots_for(table, 0, TOKENS)]
            assert not (rows == MARK).any()
    assert counters.get("nixl_page_leases") == 1
    sender.release(True, peer_done=True)


def test_a_borrowed_prefix_page_keeps_its_kv(plane, reader, pool):
    donor = pool.allocator.allocate("donor", PAGE)
    pool.k[:, donor[0]] = PREFIX
    pool.v[:, donor[0]] = PREFIX
    pool.allocator.mark_written("donor", PAGE)
    pool.allocator.give_to_cache("donor", donor)
    pool.allocator.free("donor")  # the page stays cached, lent to the next request
    table = pool.allocator.allocate("r", TOKENS, borrowed=donor)
    _store_layer0(pool, table, PAGE, TOKENS)
    sender = _sender(plane, pool, Counters())
    ref = _first_chunk(sender, pool, table, TOKENS)
    prefix = _read(reader, plane, ref.nixl_buffer_metadata,
                   *_slot(pool, pool.k, 2, table, 0, PAGE))
    assert (prefix == PREFIX).all()
    fresh = _read(reader, plane, ref.nixl_buffer_metadata,
                  *_slot(pool, pool.k, 2, table, PAGE, PAGE))
    assert (fresh == 0).all()
    sender.release(True, peer_done=True)


def test_a_handoff_that_falls_back_to_the_packed_buffer_is_not_a_page_lease(plane, pool,
                                                                           monkeypatch):
    def refuse(regions, share):
        raise RuntimeError("NIXL_ERR_BACKEND")

    monkeypatch.setattr(plane.agent, "register_regions", refuse)
    counters = Counters()
    table = pool.allocator.allocate("r", TOKENS)
    sender = _sender(plane, pool, counters)
    _first_chunk(sender, pool, table, TOKENS)
    assert sender.fallback is not None
    assert counters.get("nixl_page_registrations_failed") == 1
    assert counters.get("nixl_page_leases") == 0
    assert counters.get("nixl_page_lease_fallbacks") == 0  # the cap did not refuse it
    sender.release(True, peer_done=True)


def test_pages_no_longer_held_are_never_zeroed(pool):
    """What a released owner had written is unknown and its first pages may be the prefix
    cache's: the scrub zeroes nothing and says so (None), so nothing is registered."""
    from prefill_svc.page_scrub import scrub_unwritten

    pages = pool.allocator.allocate("gone", 3 * pool.page_size)
    pool.k.fill_(7.0)
    pool.v.fill_(7.0)
    pool.release("gone")
    before = (pool.k.clone(), pool.v.clone())
    assert scrub_unwritten(pool, "gone", pages, 3 * pool.page_size, pool.page_size) is None
    assert torch.equal(pool.k, before[0]) and torch.equal(pool.v, before[1])
