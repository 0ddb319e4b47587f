"""NixlPagesSender on its own (SPEC P-68), with a real agent and pool in this process: chunks
split at every run of page slots, each reference names exactly the pool bytes of its K and V,
only the handoff's slots are registered and they are deregistered before the pages go back;
a release before the engine is done frees the pages at once; a registration NIXL refuses
falls back to the packed buffer (P-66), nothing held, and so does one whose registration's
metadata would not fit its first frame."""

from __future__ import annotations

import ctypes

import pytest
import torch

from common.counters import Counters
from common.handoff.binding import new_nonce
from common.handoff.layout import KvLayout
from common.kvpool.kv_cache import KvPool, PoolConfig
from common.ops.torch_ops import TorchOps
from common.pb.kvhandoff.v1 import handoff_pb2
from prefill_svc.nixl_pages_sender import NixlPagesSender
from prefill_svc.nixl_sender import NixlPlane
from prefill_svc.page_lease import LeaseBudget, PageLeaseConfig
from tests.planes.nixl_env import nixl_or_skip

LAYOUT = KvLayout(2, 2, 16, torch.float32)
TOKENS = 40  # 3 pages of 16


@pytest.fixture(scope="module")
def plane():
    p = NixlPlane(nixl_or_skip())
    yield p
    p.close()


@pytest.fixture
def pool():
    # freed pages poisoned: these tables name pages no allocator handed out, and the P-68a scrub
    # (prefill_svc/page_scrub.py, tested in test_nixl_pages_scrub.py) is not what is tested here
    p = KvPool(PoolConfig(256, 16, poison_freed=True), 2, 2, 16, torch.float32,
               torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    p.k.normal_(generator=gen)
    p.v.normal_(generator=gen)
    return p


def _sender(plane, pool, returned, counters=None, max_metadata=4 << 20):
    counters = counters or Counters()
    budget = LeaseBudget(PageLeaseConfig(), pool.allocator.num_pages, counters)
    assert budget.take(3)
    return NixlPagesSender("r", LAYOUT, TOKENS, plane, pool, budget, returned.append,
                           counters, max_metadata), budget


def _frames(sender, pool, table):
    """Every chunk of both layers, as the engine emits them -> [(layer, KvChunk)]."""
    rows = torch.tensor(table, dtype=torch.int32)
    out, seq, nonce = [], 0, new_nonce()
    for layer in range(LAYOUT.num_layers):
        for start, count in sender.spans(rows, 0, TOKENS, 16):
            kv = sender.pack(TorchOps(), pool.k[layer], pool.v[layer], rows, start, count)
            frame = sender.chunk("r", seq, layer, start, kv, nonce)
            out.append((layer, handoff_pb2.PrefillResponse.FromString(frame).chunk))
            seq += 1
    return out


def _bytes_at(address: int, length: int) -> bytes:
    return ctypes.string_at(address, length)


def test_chunks_split_at_runs_and_name_the_pool_bytes(plane, pool):
    table = [5, 6, 2]  # tokens 0-31 in adjacent pages 5-6, 32-39 in page 2
    returned: list[str] = []
    sender, budget = _sender(plane, pool, returned)
    chunks = _frames(sender, pool, table)
    assert [(c.token_start, c.token_end) for _, c in chunks] == [(0, 16), (16, 32), (32, 40)] * 2
    first = chunks[0][1].ref
    assert first.nixl_buffer_metadata and not any(c.ref.nixl_buffer_metadata
                                                  for _, c in chunks[1:])
    row = 2 * 16 * 4
    for layer, c in chunks:
        ref = c.ref
        assert ref.nixl_address == first.nixl_address and ref.length == (
            c.token_end - c.token_start) * row
        page, offset = table[c.token_start // 16], c.token_start % 16
        k = pool.k[layer, page, offset:offset + c.token_end - c.token_start]
        v = pool.v[layer, page, offset:offset + c.token_end - c.token_start]
        assert ref.nixl_address + ref.k_offset == k.data_ptr()
        assert ref.nixl_address + ref.v_offset == v.data_ptr()
        assert _bytes_at(k.data_ptr(), ref.length) == k.numpy().tobytes()
    owner = sender.hold("r")
    assert owner and returned == [] and plane._pinned == 1
    sender.release(True, peer_done=True)
    assert returned == [owner] and plane._pinned == 0 and sender._reg is None
    assert budget.pages == 0 and budget.handoffs == 0
    sender.release(True)  # once only
    assert returned == [owner]


def test_a_release_before_the_engine_is_done_frees_the_pages_at_once(plane, pool):
    returned: list[str] = []
    counters = Counters()
    sender, budget = _sender(plane, pool, returned, counters)
    _frames(sender, pool, [0, 1, 2])
    sender.release(False)  # decode released (or the stream died) mid-prefill
    assert sender.hold("r") is None  # the engine frees the pages itself
    assert returned == [] and budget.handoffs == 0
    assert "nixl_lease_pages_held" not in counters.snapshot()
    rows = torch.tensor([0, 1, 2], dtype=torch.int32)
    kv = sender.pack(TorchOps(), pool.k[0], pool.v[0], rows, 0, 16)
    assert sender.chunk("r", 99, 0, 0, kv, new_nonce()) is None


def test_a_registration_nixl_refuses_falls_back_to_the_packed_buffer(plane, pool, monkeypatch):
    def refuse(regions, share):
        raise RuntimeError("NIXL_ERR_BACKEND")

    monkeypatch.setattr(plane.agent, "register_regions", refuse)
    returned: list[str] = []
    counters = Counters()
    sender, budget = _sender(plane, pool, returned, counters)
    chunks = _frames(sender, pool, [0, 1, 2])
    assert sender.fallback is not None and budget.handoffs == 0
    assert counters.get("nixl_page_registrations_failed") == 1
    base = chunks[0][1].ref.nixl_address
    assert base == sender.fallback._reg.address  # the packed buffer, not the pool
    layer, c = chunks[0]
    k = pool.k[layer, 0, :16].numpy().tobytes()
    assert _bytes_at(base + c.ref.k_offset, c.ref.length) == k
    assert sender.hold("r") is None  # nothing held: the engine frees the pages
    sender.release(True, peer_done=True)
    assert returned == [] and sender.fallback._reg is None


def test_metadata_too_large_for_a_frame_falls_back_to_the_packed_buffer(plane, pool):
    returned: list[str] = []
    counters = Counters()
    sender, budget = _sender(plane, pool, returned, counters, max_metadata=64)
    chunks = _frames(sender, pool, [0, 2, 4])  # 3 runs x 2 layers x K, V: 12 regions
    assert sender.fallback is not None and budget.handoffs == 0
    assert counters.get("nixl_page_lease_fragmented") == 1
    assert chunks[0][1].ref.nixl_address == sender.fallback._reg.address
    sender.release(True, peer_done=True)
    assert returned == [] and plane._pinned == 0
