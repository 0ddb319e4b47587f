"""NIXL handoffs READ straight from prefill's KV pages (SPEC P-68): a real prefill service in its
own process (tests.planes.nixl_pages_prefill) and decode's real NixlReceiver and engine here,
over loopback. The pages land exactly what the packed path lands and pass decode's checks; the
pages stay out of prefill's pool until ReleaseHandoff, or until the lease's grace period ends;
a READ after the release is refused and both pools come back; cached pages a lease holds are
not evicted; past the lease's cap a handoff is packed."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from common.handoff.binding import new_nonce, prompt_digest
from common.handoff.layout import KvLayout, protocol_version
from common.handoff.reasons import HandoffRefused
from common.handoff.transfer import TransferRecord, TransferState
from common.handoff.verifier import Expectation
from common.kvpool.kv_cache import PoolConfig
from common.pb.kvhandoff.v1 import handoff_pb2
from common.sampling import SamplingConfig
from decode_svc.engine_answer import engine_answer
from decode_svc.kv_receiver import HandoffJob
from decode_svc.nixl_receiver import NixlReceiver
from decode_svc.prefill_client import PrefillClient
from tests.isolation.inproc import Harness
from tests.planes.nixl_pages_prefill import FINGERPRINT, PagesPrefill, PagesPrefillSpec
from tests.planes.test_shared_memory_refusals import FakeClient

PROMPT = list(range(3, 40))  # 37 tokens: 3 pages of 16
CHUNK_BYTES = 16 * 256  # 16 tokens of one layer's K and V (tiny model: 256 bytes a token)

@pytest.fixture
def harness():
    h = Harness(PoolConfig(pool_tokens=512, page_size=16))
    yield h
    h.close()


def _start(spec: PagesPrefillSpec | None = None) -> PagesPrefill:
    service = PagesPrefill(spec or PagesPrefillSpec())
    if service.why:
        service.close()
        pytest.skip(service.why)
    return service


@pytest.fixture
def prefill():
    service = _start()
    yield service
    service.close()


def _layout(h: Harness) -> KvLayout:
    c = h.model.config
    return KvLayout(c.num_layers, c.num_kv_heads, c.head_dim, h.model.dtype)


class HeldRelease:
    """decode's real client, but its ReleaseHandoff is the test's to send (or not)."""

    def __init__(self, client: PrefillClient) -> None:
        self.client = client
        self.released: list[tuple[str, bytes]] = []

    def prefill(self, request, timeout):
        return self.client.prefill(request, timeout)

    async def release(self, request_id, nonce, timeout):
        self.released.append((request_id, nonce))
        return True


def _request(request_id: str, prompt: list[int], nonce: bytes, scope: bytes = b""):
    return handoff_pb2.PrefillRequest(
        request_id=request_id, token_ids=prompt, protocol_version=protocol_version(),
        nonce=nonce, model_fingerprint=FINGERPRINT, sampling=SamplingConfig().to_proto(),
        max_chunk_bytes=CHUNK_BYTES, cache_scope=scope,
        data_plane=handoff_pb2.DATA_PLANE_NIXL)


async def _land(h: Harness, receiver: NixlReceiver, client, request_id: str, prompt=PROMPT,
                scope=b"", nonce: bytes | None = None):
    """One handoff READ into decode's reservation -> (landed or the refusal, record, nonce)."""
    nonce = nonce or new_nonce()
    receiver.client, receiver.engine = client, h.engine
    await engine_answer(lambda done: h.engine.reserve(request_id, len(prompt), done))
    expect = Expectation(request_id, len(prompt), _layout(h), FINGERPRINT, CHUNK_BYTES,
                         h.model.config.vocab_size, nonce, prompt_digest(prompt))
    record = TransferRecord(request_id, "nixl")
    try:
        landed = await receiver.receive(
            HandoffJob(_request(request_id, prompt, nonce, scope), expect, SamplingConfig(),
                       30.0), record)
    except HandoffRefused as err:
        landed = err
    finally:
        await asyncio.gather(*receiver._releases)
    return landed, record, nonce


def _landed_kv(h: Harness, request_id: str, n: int) -> list[torch.Tensor]:
    h.drain()
    pool = h.pool
    table = torch.tensor(pool.allocator.page_table(request_id), dtype=torch.int32)
    return [h.model.ops.pack_kv(pool.k[layer], pool.v[layer], table, 0, n)
            for layer in range(h.model.config.num_layers)]


async def _verify(h: Harness, request_id: str, prompt=PROMPT) -> int:
    """decode's content checks over what landed -> its own first token (raises when refused)."""
    answer = await engine_answer(lambda done: h.engine.verify(request_id, prompt,
                                                              SamplingConfig(), done))
    if isinstance(answer, Exception):
        raise answer
    return answer.first_token_id


def _wait(prefill: PagesPrefill, ok, what: str, timeout_s: float = 10.0) -> dict:
    end = time.monotonic() + timeout_s
    while not ok(stats := prefill.stats()):
        assert time.monotonic() < end, f"{what}: {stats}"
        time.sleep(0.02)
    return stats


def _held_now(stats: dict) -> int:
    """Pages leases hold now: those that passed to a hold owner less those returned."""
    counters = stats["counters"]
    return counters.get("nixl_lease_pages_held", 0) - counters.get("nixl_lease_pages_returned", 0)


def _release(address: str, request_id: str, nonce: bytes) -> bool:
    async def go():
        client = PrefillClient(address, CHUNK_BYTES, None)
        try:
            return await client.release(request_id, nonce, 5.0)
        finally:
            await client.close()
    return asyncio.run(go())


def _fetch_frames(address: str, request: handoff_pb2.PrefillRequest) -> list[bytes]:
    """The whole handoff stream, nothing READ (the frames serialized as they came)."""
    async def go():
        client = PrefillClient(address, CHUNK_BYTES, None)
        try:
            return [frame.SerializeToString() if hasattr(frame, "SerializeToString")
                    else frame for frame in [f async for f in client.stub.Prefill(request)]]
        finally:
            await client.close()
    return asyncio.run(go())


def test_the_pages_land_what_the_packed_path_lands_and_pass_the_checks(harness, receiver):
    """A fragmented pool (the handoff's pages are not adjacent, so chunks split at each run):
    what lands from the pages and from a packed buffer is the prompt's KV (two processes
    compute it to within float rounding: bit-equal landing of one process's KV over both paths
    is test_past_the_cap_a_handoff_is_packed), and decode's content checks give the same first
    token on both."""
    packed = _start(PagesPrefillSpec(lease_enabled=False))
    pages = _start()
    try:
        pages.ask("fragment", 6)
        results = {}
        for name, service in (("pages", pages), ("packed", packed)):
            async def go(service=service, name=name):
                client = PrefillClient(service.address, CHUNK_BYTES, None)
                try:
                    landed, record, _ = await _land(harness, receiver, client, name)
                    assert record.state == TransferState.SUCCESS, landed
                    return landed, await _verify(harness, name)
                finally:
                    await client.close()
            landed, first = asyncio.run(go())
            results[name] = (landed.first_token, first, _landed_kv(harness, name, len(PROMPT)))
            harness.engine.release(name)
        want_first, want_kv, _ = harness.prefill(PROMPT)
        for name, (advisory, first, kv) in results.items():
            assert advisory == first == want_first, name
            for got, want in zip(kv, want_kv, strict=True):
                torch.testing.assert_close(got, want)
        counters = pages.stats()["counters"]
        assert counters["nixl_page_leases"] == 1 and "nixl_page_lease_fallbacks" not in counters
        assert packed.stats()["counters"].get("nixl_page_leases", 0) == 0
    finally:
        pages.close()
        packed.close()


def test_over_an_earlier_requests_unscrubbed_pages_a_chunked_handoff_lands_its_own_kv(
        harness, receiver):
    """SPEC P-68a with the real model: a pool that keeps freed pages' KV (no poison, no scrub)
    and a chunked prefill (16-token passes, so most slots are registered long before they are
    written); an earlier request's handoff leaves its KV in the pages the next one gets. The
    scrub before the registration zeroes only slots not written yet: what lands is the
    prompt's KV and decode's content checks give its first token."""
    prefill = _start(PagesPrefillSpec(poison_freed=False, prefill_chunk_tokens=16))
    try:
        earlier = [t + 50 for t in PROMPT]

        async def go():
            client = PrefillClient(prefill.address, CHUNK_BYTES, None)
            try:
                first, record, _ = await _land(harness, receiver, client, "earlier", earlier)
                assert record.state == TransferState.SUCCESS, first
                harness.engine.release("earlier")
                landed, record, _ = await _land(harness, receiver, client, "later")
                assert record.state == TransferState.SUCCESS, landed
                return landed, await _verify(harness, "later")
            finally:
                await client.close()

        landed, first = asyncio.run(go())
        kv = _landed_kv(harness, "later", len(PROMPT))
        harness.engine.release("later")
        want_first, want_kv, _ = harness.prefill(PROMPT)
        assert landed.first_token == first == want_first
        for got, want in zip(kv, want_kv, strict=True):
            torch.testing.assert_close(got, want)
        assert prefill.stats()["counters"]["nixl_page_leases"] == 2
    finally:
        prefill.close()


def test_pages_are_held_until_release_handoff_and_then_returned(harness, receiver, prefill):
    baseline = prefill.stats()["pages_free"]
    decode_baseline = harness.pages_free()

    async def go():
        client = PrefillClient(prefill.address, CHUNK_BYTES, None)
        try:
            return await _land(harness, receiver, HeldRelease(client), "held")
        finally:
            await client.close()

    landed, record, nonce = asyncio.run(go())
    assert record.state == TransferState.SUCCESS, landed
    stats = _wait(prefill, lambda s: _held_now(s) == 3, "the lease holds the 3 pages")
    assert stats["pages_free"] == baseline - 3  # not free: decode has not released them
    assert _release(prefill.address, "held", nonce)
    stats = _wait(prefill, lambda s: s["pages_free"] == baseline, "pages back after release")
    assert _held_now(stats) == 0 and stats["counters"]["nixl_lease_pages_returned"] == 3
    assert "nixl_page_leases_expired" not in stats["counters"]
    assert not _release(prefill.address, "held", nonce)  # once only
    harness.engine.release("held")
    assert harness.pages_free() == decode_baseline


def test_a_lease_nobody_releases_returns_the_pages_after_the_grace(harness, receiver):
    prefill = _start(PagesPrefillSpec(release_grace_s=0.3))
    try:
        baseline = prefill.stats()["pages_free"]

        async def go():
            client = PrefillClient(prefill.address, CHUNK_BYTES, None)
            try:
                return await _land(harness, receiver, HeldRelease(client), "orphan")
            finally:
                await client.close()

        landed, record, nonce = asyncio.run(go())
        assert record.state == TransferState.SUCCESS, landed
        stats = _wait(prefill, lambda s: s["pages_free"] == baseline, "pages back after grace")
        assert stats["counters"]["nixl_page_leases_expired"] == 1
        assert _held_now(stats) == 0
        assert not _release(prefill.address, "orphan", nonce)  # already gone
        harness.engine.release("orphan")
    finally:
        prefill.close()


def test_a_read_after_the_release_is_refused_and_both_pools_come_back(harness, receiver, prefill):
    """decode READs only after prefill released the pages (they are poisoned on free and no
    longer registered): what lands, if anything, fails the checksums; nothing is accepted."""
    baseline = prefill.stats()["pages_free"]
    decode_baseline = harness.pages_free()
    nonce = new_nonce()
    frames = _fetch_frames(prefill.address, _request("late", PROMPT, nonce))
    assert _release(prefill.address, "late", nonce)
    _wait(prefill, lambda s: s["pages_free"] == baseline, "pages back after release")
    client = FakeClient(frames)
    err, record, _ = asyncio.run(_land(harness, receiver, client, "late", nonce=nonce))
    assert isinstance(err, HandoffRefused), err
    # UCX over shared memory / TCP does not enforce the deregistration: the READ lands the
    # poisoned pages (CHECKSUM_MISMATCH); a transport that does fails it (TRANSFER_FAILED).
    # Not a timeout: prefill's agent keeps progressing a while after its last release
    assert err.reason in ("CHECKSUM_MISMATCH", "TRANSFER_FAILED"), err
    assert record.state == TransferState.FAILED
    assert receiver.quarantine.held_pages == 0
    harness.engine.release("late")

    async def good():  # decode serves the next handoff
        real = PrefillClient(prefill.address, CHUNK_BYTES, None)
        try:
            return await _land(harness, receiver, real, "next")
        finally:
            await real.close()

    landed, record, _ = asyncio.run(good())
    assert record.state == TransferState.SUCCESS, landed
    harness.engine.release("next")
    end = time.monotonic() + 10
    while receiver.quarantine.held_pages and time.monotonic() < end:
        time.sleep(0.02)
    assert receiver.quarantine.held_pages == 0
    assert harness.pages_free() == decode_baseline
    _wait(prefill, lambda s: s["pages_free"] == baseline, "prefill's pool at baseline")


def test_cached_pages_a_lease_holds_are_not_evicted(harness, receiver, prefill):
    """A scoped prompt's whole pages join the prefix cache at its commit while its lease holds
    them; a request that needs every page of the pool waits instead of evicting them, and the
    held bytes are still the prompt's (a READ of them passes its checksums) until release."""
    scope = b"tenant-a"
    total = prefill.stats()["pages_free"]
    nonce = new_nonce()
    frames = _fetch_frames(prefill.address, _request("cached", PROMPT, nonce, scope))
    stats = _wait(prefill, lambda s: s["pages_cached"] == 2, "2 whole pages cached")
    assert stats["pages_free"] == total - 3

    async def go():
        big = PrefillClient(prefill.address, CHUNK_BYTES, None)
        tokens = [3 + i % 90 for i in range(16 * total - 8)]  # every page of the pool
        request = _request("everything", tokens, new_nonce())
        request.data_plane = handoff_pb2.DATA_PLANE_INLINE
        call = asyncio.ensure_future(big.stub.Prefill(request).read())  # its header, then waits
        try:
            await asyncio.sleep(1.0)
            stats = await asyncio.to_thread(prefill.stats)
            assert stats["waiting"] == 1 and stats["pages_cached"] == 2, stats
            landed, record, _ = await _land(harness, receiver, FakeClient(frames), "cached",
                                            scope=scope, nonce=nonce)
            assert record.state == TransferState.SUCCESS, landed  # the bytes are unchanged
        finally:
            call.cancel()
            await big.close()

    asyncio.run(go())
    assert _release(prefill.address, "cached", nonce)
    stats = _wait(prefill, lambda s: s["pages_available"] == total and s["waiting"] == 0,
                  "the pool is whole once the lease and the big request are done")
    harness.engine.release("cached")


def test_past_the_cap_a_handoff_is_packed(harness, receiver):
    prefill = _start(PagesPrefillSpec(lease_max_pages=4))
    try:
        baseline = prefill.stats()["pages_free"]

        async def go():
            client = PrefillClient(prefill.address, CHUNK_BYTES, None)
            held = HeldRelease(client)
            try:
                first = await _land(harness, receiver, held, "first")
                second = await _land(harness, receiver, held, "second")  # 3 + 3 pages > 4
                return first, second
            finally:
                await client.close()

        (a, ra, na), (b, rb, nb) = asyncio.run(go())
        assert ra.state == rb.state == TransferState.SUCCESS, (a, b)
        for got, want in zip(_landed_kv(harness, "first", len(PROMPT)),
                             _landed_kv(harness, "second", len(PROMPT)), strict=True):
            assert torch.equal(got, want)
        counters = prefill.stats()["counters"]
        assert counters["nixl_page_leases"] == 1 and counters["nixl_page_lease_fallbacks"] == 1
        assert counters["nixl_lease_pages_held"] == 3  # only the first's pages are held
        assert "nixl_lease_pages_returned" not in counters
        assert _release(prefill.address, "first", na) and _release(prefill.address, "second", nb)
        _wait(prefill, lambda s: s["pages_free"] == baseline, "pages back after release")
        harness.engine.release("first")
        harness.engine.release("second")
    finally:
        prefill.close()



def test_concurrent_chunked_handoffs_all_land_and_all_pages_return(harness, receiver):
    """Four handoffs at once, their prompts computed 16 tokens a pass (so later passes write
    pages the first chunk already registered), each released by decode as soon as it landed
    (the release may reach prefill before or after its engine passed the pages to the hold
    owner): every one lands, and prefill's pool is at baseline with nothing held."""
    prefill = _start(PagesPrefillSpec(lease_max_pages=16, prefill_chunk_tokens=16))
    try:
        _concurrent(harness, receiver, prefill)
    finally:
        prefill.close()


def _concurrent(harness, receiver, prefill):
    baseline = prefill.stats()["pages_free"]
    decode_baseline = harness.pages_free()

    async def go():
        client = PrefillClient(prefill.address, CHUNK_BYTES, None)
        try:
            prompts = [[3 + (i * 7 + t) % 90 for t in range(20 + 9 * i)] for i in range(4)]
            results = await asyncio.gather(*(
                _land(harness, receiver, client, f"many-{i}", prompt)
                for i, prompt in enumerate(prompts)))
            for i, (landed, record, _) in enumerate(results):
                assert record.state == TransferState.SUCCESS, landed
                # decode's content checks pass on what landed, and agree on the first token
                assert await _verify(harness, f"many-{i}", prompts[i]) == landed.first_token
        finally:
            await client.close()

    asyncio.run(go())
    stats = _wait(prefill, lambda s: s["pages_free"] == baseline, "pages back after releases")
    assert _held_now(stats) == 0 and stats["counters"]["nixl_page_leases"] == 4
    assert stats["counters"]["handoff_releases"] == 4
    for i in range(4):
        harness.engine.release(f"many-{i}")
    assert harness.pages_free() == decode_baseline
