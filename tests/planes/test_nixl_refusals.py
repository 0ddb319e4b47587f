"""Decode's NIXL receiver fails closed: it READs each chunk straight into the reservation's
pages (a CPU pool; a staging buffer of its own elsewhere) and the 1.1 checksums are checked over
what landed; corrupt bytes, a READ that never completes, a peer killed mid-transfer and
references outside the buffer are refused, the pages come back, pages (or a staging buffer) a
READ may still land in are never handed out before the transfer is over (D-67a), and decode
serves the next handoff; prefill frees a buffer decode never releases once the grace period
passes."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import torch

from common.counters import Counters
from common.errors import ServiceError
from common.handoff.binding import new_nonce, prompt_digest
from common.handoff.codec import commit_frame, frame_wire, header_frame
from common.handoff.reasons import HandoffRefused
from common.handoff.transfer import TransferRecord, TransferState
from common.handoff.verifier import Expectation
from common.pb.kvhandoff.v1 import handoff_pb2
from common.sampling import SamplingConfig
from decode_svc.engine_answer import engine_answer
from decode_svc.kv_receiver import HandoffJob
from decode_svc.nixl_receiver import NixlReceiver
from prefill_svc.handoff_leases import HandoffLeases
from prefill_svc.nixl_sender import NixlPlane, NixlSender
from tests.isolation.inproc import Harness
from tests.planes.nixl_env import READ_TIMEOUT_S
from tests.planes.nixl_peer import NixlPeer
from tests.planes.test_shared_memory_refusals import (CHUNK_TOKENS, FINGERPRINT, PROMPT,
                                                      FakeClient, _landed_kv, _layout)


@pytest.fixture
def peer(harness, agent):
    p = NixlPeer(_layout(harness))
    if p.why:
        p.close()
        pytest.skip(p.why)
    yield p
    p.close()


@pytest.fixture
def staging_receiver(agent):
    """The path a GPU pool takes: READs into a staging buffer, then the engine's writes."""
    r = NixlReceiver(None, None, agent, Counters(), READ_TIMEOUT_S, into_pages=False)
    yield r
    asyncio.run(r.close())


def _quarantine_over(receiver: NixlReceiver, timeout_s: float = 30.0) -> None:
    """Waits (bounded) until every quarantined READ is known over and its pages released."""
    end = time.monotonic() + timeout_s
    while receiver.quarantine.held_pages and time.monotonic() < end:
        time.sleep(0.01)
    assert receiver.quarantine.held_pages == 0, receiver.quarantine.owners()


def _handoff(h: Harness, peer: NixlPeer, request_id: str, nonce: bytes):
    first, kv, _ = h.prefill(PROMPT)
    layout = _layout(h)
    frames = [frame_wire(header_frame(request_id, len(PROMPT), handoff_pb2.HANDOFF_STATUS_OK,
                                      layout, FINGERPRINT, nonce=nonce,
                                      digest=prompt_digest(PROMPT)))]
    chunks = peer.ask("frames", request_id, nonce, [t.contiguous() for t in kv], CHUNK_TOKENS)
    frames += chunks
    frames.append(frame_wire(commit_frame(request_id, len(PROMPT), len(chunks), first,
                                          nonce=nonce)))
    return frames, kv


def _run(h: Harness, receiver: NixlReceiver, client: FakeClient, request_id: str, nonce: bytes,
         cancel_after: float | None = None):
    receiver.client, receiver.engine = client, h.engine
    record = TransferRecord(request_id, "nixl")

    async def go():
        await engine_answer(lambda done: h.engine.reserve(request_id, len(PROMPT), done))
        expect = Expectation(request_id, len(PROMPT), _layout(h), FINGERPRINT, 4 << 20,
                             h.model.config.vocab_size, nonce, prompt_digest(PROMPT))
        request = handoff_pb2.PrefillRequest(request_id=request_id, token_ids=PROMPT,
                                             nonce=nonce)
        task = asyncio.ensure_future(receiver.receive(
            HandoffJob(request, expect, SamplingConfig(), 30.0), record))
        try:
            if cancel_after is not None:  # the client leaves mid-handoff
                await asyncio.sleep(cancel_after)
                task.cancel()
            return await task
        finally:
            await asyncio.sleep(0)
            await asyncio.gather(*receiver._releases)

    try:
        return asyncio.run(go()), record
    except HandoffRefused as err:
        return err, record


def _good(h, receiver, peer, request_id):
    baseline = h.pages_free()
    nonce = new_nonce()
    frames, kv = _handoff(h, peer, request_id, nonce)
    client = FakeClient(frames)
    landed, record = _run(h, receiver, client, request_id, nonce)
    assert record.state == TransferState.SUCCESS and not isinstance(landed, Exception), landed
    assert landed.payload_bytes == sum(t.numel() * t.element_size() for t in kv)
    for got, want in zip(_landed_kv(h, request_id), kv, strict=True):
        assert torch.equal(got, want)
    assert client.requests[0].data_plane == handoff_pb2.DATA_PLANE_NIXL
    assert client.released == [(request_id, nonce)]
    h.engine.release(request_id)
    assert h.pages_free() == baseline


def _refused(h, receiver, frames, nonce, request_id, die_after=None) -> HandoffRefused:
    baseline = h.pages_free()
    client = FakeClient(frames, die_after)
    err, record = _run(h, receiver, client, request_id, nonce)
    assert isinstance(err, HandoffRefused), err
    assert record.state == TransferState.FAILED and record.failure == err.reason
    assert client.call.cancelled and client.released == [(request_id, nonce)]
    h.engine.release(request_id)
    _quarantine_over(receiver)
    assert h.pages_free() == baseline
    return err


def test_a_good_handoff_lands_exactly_the_bytes_prefill_packed(harness, receiver, peer):
    _good(harness, receiver, peer, "good")
    assert receiver.pool.pages is not None  # straight into the pages: no staging buffer
    assert receiver.staging._buffers.idle_bytes == 0 and receiver.staging.quarantined == []


def test_the_staging_path_lands_the_same_bytes(harness, staging_receiver, peer):
    _good(harness, staging_receiver, peer, "good-staged")
    assert staging_receiver.pool.pages is None
    assert staging_receiver.staging._buffers.idle_bytes > 0  # handed back after the writes


def test_corrupt_landed_bytes_are_refused(harness, receiver, peer):
    nonce = new_nonce()
    frames, kv = _handoff(harness, peer, "corrupt", nonce)
    layer_bytes = kv[0].numel() * kv[0].element_size()
    peer.ask("flip", layer_bytes + 5)  # layer 1's first chunk, after prefill packed it
    err = _refused(harness, receiver, frames, nonce, "corrupt")
    assert (err.reason, err.code) == ("CHECKSUM_MISMATCH", grpc.StatusCode.DATA_LOSS)
    assert receiver.quarantine.counters.get("nixl_reads_quarantined") == 0  # the READ was DONE
    _good(harness, receiver, peer, "after-corrupt")


def _quarantined_pages(h: Harness, receiver: NixlReceiver) -> set[int]:
    (owner,) = receiver.quarantine.owners()
    return set(h.pool.allocator.page_table(owner))


def _not_reused_until_over(h: Harness, receiver: NixlReceiver, peer: NixlPeer, baseline,
                           stale: set[int]) -> None:
    """While the READ may land: the stale pages stay out of the pool (a reservation of every
    free page gets none of them); once the peer progresses, the READ ends and they come back."""
    free, total = h.pages_free()
    assert (free + len(stale), total) == baseline
    asyncio.run(engine_answer(lambda done: h.engine.reserve("everything", free * 16, done)))
    assert not set(h.pool.allocator.page_table("everything")) & stale
    h.engine.release("everything")
    assert receiver.quarantine.held_pages == len(stale)  # still in flight: still held
    peer.ask("resume")
    _quarantine_over(receiver)
    assert h.pages_free() == baseline
    counters = receiver.quarantine.counters
    assert counters.get("nixl_quarantines_ended") == counters.get("nixl_reads_quarantined") == 1


def test_a_read_that_never_completes_quarantines_its_pages_until_the_transfer_ends(
        harness, receiver, peer):
    baseline = harness.pages_free()
    nonce = new_nonce()
    frames, _ = _handoff(harness, peer, "stalled", nonce)
    peer.ask("stall")
    resumed = False
    try:
        client = FakeClient(frames)
        err, record = _run(harness, receiver, client, "stalled", nonce)
        assert isinstance(err, HandoffRefused), err
        assert (err.reason, err.code) == ("TRANSFER_TIMEOUT", grpc.StatusCode.DEADLINE_EXCEEDED)
        assert record.state == TransferState.FAILED and client.released == [("stalled", nonce)]
        stale = _quarantined_pages(harness, receiver)
        assert stale and not stale & set(harness.pool.allocator.page_table("stalled"))
        harness.engine.release("stalled")
        resumed = True
        _not_reused_until_over(harness, receiver, peer, baseline, stale)
    finally:
        if not resumed:
            peer.ask("resume")
    _good(harness, receiver, peer, "after-stall")  # decode still serves


def test_the_staging_path_never_reuses_a_buffer_a_read_may_land_in(
        harness, staging_receiver, peer):
    receiver = staging_receiver
    nonce = new_nonce()
    frames, _ = _handoff(harness, peer, "stalled", nonce)
    peer.ask("stall")
    try:
        err = _refused(harness, receiver, frames, nonce, "stalled")
    finally:
        peer.ask("resume")
    assert (err.reason, err.code) == ("TRANSFER_TIMEOUT", grpc.StatusCode.DEADLINE_EXCEEDED)
    assert len(receiver.staging.quarantined) == 1
    stale = receiver.staging.quarantined[0][0]
    assert receiver.staging.counters.get("nixl_buffers_quarantined") == 1
    _good(harness, receiver, peer, "after-stall")  # decode still serves, in another buffer
    assert receiver.staging.acquire(4 << 20)[0] is not stale


class _KillingList(list):
    """The frames, with the peer killed once decode asks for frame `at` (earlier chunks were
    READ over a live connection)."""

    def __init__(self, frames, peer, at):
        super().__init__(frames)
        self.peer, self.at = peer, at

    def __iter__(self):
        for i, frame in enumerate(list.__iter__(self)):
            if i == self.at:
                self.peer.kill()
            yield frame


def test_a_handoff_cancelled_mid_read_quarantines_the_pages_the_read_may_land_in(
        harness, receiver, peer):
    baseline = harness.pages_free()
    nonce = new_nonce()
    frames, _ = _handoff(harness, peer, "cancelled", nonce)
    peer.ask("stall")
    resumed = False
    try:
        with pytest.raises(asyncio.CancelledError):
            _run(harness, receiver, FakeClient(frames), "cancelled", nonce, cancel_after=0.5)
        stale = _quarantined_pages(harness, receiver)
        harness.engine.release("cancelled")
        resumed = True
        _not_reused_until_over(harness, receiver, peer, baseline, stale)
    finally:
        if not resumed:
            peer.ask("resume")
    _good(harness, receiver, peer, "after-cancel")


@pytest.mark.parametrize("at", [1, 3])
def test_a_peer_killed_mid_transfer_is_refused(harness, receiver, peer, at):
    nonce = new_nonce()
    frames, _ = _handoff(harness, peer, "killed", nonce)
    err = _refused(harness, receiver, _KillingList(frames, peer, at), nonce, "killed")
    assert (err.reason, err.code) == ("TRANSFER_FAILED", grpc.StatusCode.UNAVAILABLE)
    assert "chunk" in err.message
    restarted = NixlPeer(_layout(harness))  # prefill restarted: decode serves it
    try:
        _good(harness, receiver, restarted, "after-kill")
    finally:
        restarted.close()


def test_a_reference_past_its_buffer_is_refused_before_any_read(harness, receiver, peer):
    nonce = new_nonce()
    frames, _ = _handoff(harness, peer, "past", nonce)
    bad = handoff_pb2.PrefillResponse.FromString(frames[2])
    bad.chunk.ref.k_offset = bad.chunk.ref.nixl_buffer_size
    frames[2] = bad.SerializeToString()
    err = _refused(harness, receiver, frames, nonce, "past")
    assert err.reason == "REGION_INVALID" and "past the end" in err.message


def test_a_buffer_no_chunk_described_is_refused(harness, receiver, peer):
    nonce = new_nonce()
    frames, _ = _handoff(harness, peer, "undescribed", nonce)
    bad = handoff_pb2.PrefillResponse.FromString(frames[1])
    bad.chunk.ref.nixl_buffer_metadata = b""
    frames[1] = bad.SerializeToString()
    err = _refused(harness, receiver, frames, nonce, "undescribed")
    assert err.reason == "REGION_INVALID" and "no earlier" in err.message


def test_bytes_and_a_reference_together_are_refused(harness, receiver, peer):
    nonce = new_nonce()
    frames, _ = _handoff(harness, peer, "both", nonce)
    bad = handoff_pb2.PrefillResponse.FromString(frames[1])
    bad.chunk.k = b"\0" * bad.chunk.ref.length
    frames[1] = bad.SerializeToString()
    err = _refused(harness, receiver, frames, nonce, "both")
    assert err.reason == "REFERENCE_UNEXPECTED"


def test_a_release_that_never_comes_frees_the_buffer_after_the_grace(harness, agent):
    """prefill's side, in this process: the lease expires, the buffer is deregistered."""
    nonce = new_nonce()
    plane = NixlPlane(agent)
    try:
        counters = Counters()
        leases = HandoffLeases(0.1, counters)
        sender = NixlSender("never", _layout(harness), len(PROMPT), plane)
        _, kv, _ = harness.prefill(PROMPT)
        assert sender.chunk("never", 0, 0, 0, kv[0][:, :CHUNK_TOKENS].contiguous(), nonce)
        assert plane._pinned == 1

        async def go():
            leases.add("never", nonce, sender)
            leases.stream_ended("never", nonce, completed=True)
            assert not leases.release("never", b"x" * 16)  # only the right nonce releases
            await asyncio.sleep(0.3)

        asyncio.run(go())
        assert counters.get("handoff_releases_expired") == 1 and leases.held() == 0
        assert plane._pinned == 0 and sender._reg is None
        assert sender.chunk("never", 1, 0, CHUNK_TOKENS, kv[0][:, :4].contiguous(), nonce) is None
    finally:
        plane.close()


def test_decode_unloads_a_peer_once_it_holds_many_buffer_sections(harness, receiver, peer,
                                                                   monkeypatch):
    """NIXL's lookups slow with every buffer section loaded: decode drops the peer after
    MAX_SECTIONS_PER_PEER of them, when no handoff uses it, and reconnects on the next."""
    monkeypatch.setattr("decode_svc.nixl_receiver.MAX_SECTIONS_PER_PEER", 2)
    removed = []
    real = receiver.agent.remove_remote
    monkeypatch.setattr(receiver.agent, "remove_remote",
                        lambda name: (removed.append(name), real(name)))
    _good(harness, receiver, peer, "one")
    peer.ask("release")  # its buffer is reused: the next handoff sends the same metadata
    assert removed == []
    _good(harness, receiver, peer, "two")
    peer.ask("release")
    assert len(removed) == 1 and receiver._sections == {} and receiver._users == {}
    _good(harness, receiver, peer, "three")  # reconnected from the next handoff's metadata


@pytest.mark.parametrize("one_pass", [True, False])
@pytest.mark.parametrize("where", ["first", "last"])
def test_a_nan_read_into_the_pages_is_refused_at_verify_and_frees_them(harness, agent, peer,
                                                                       one_pass, where):
    """Prefill's buffer holds a NaN it checksummed (every frame passes): the READ lands it in the
    pages, the finiteness check over them (the one pass, or the engine's own) finds it, and the
    request is refused KV_NOT_FINITE with its pages back. In the first chunk, every later chunk
    is all finite (the receiver tells the engine nothing of those): the NaN is still refused."""
    receiver = NixlReceiver(None, None, agent, Counters(), READ_TIMEOUT_S, one_pass=one_pass)
    baseline = harness.pages_free()
    nonce = new_nonce()
    first, kv, _ = harness.prefill(PROMPT)
    if where == "last":
        kv[-1][1, -1, -1, -1] = float("nan")  # the last layer's V, last token
    else:
        kv[0][0, 0, 0, 0] = float("nan")  # layer 0's K, first token: the first chunk
    layout = _layout(harness)
    frames = [frame_wire(header_frame("nan", len(PROMPT), handoff_pb2.HANDOFF_STATUS_OK, layout,
                                      FINGERPRINT, nonce=nonce, digest=prompt_digest(PROMPT)))]
    chunks = peer.ask("frames", "nan", nonce, [t.contiguous() for t in kv], CHUNK_TOKENS)
    frames += chunks + [frame_wire(commit_frame("nan", len(PROMPT), len(chunks), first,
                                                nonce=nonce))]
    try:
        landed, record = _run(harness, receiver, FakeClient(frames), "nan", nonce)
        assert record.state == TransferState.SUCCESS, landed  # the form is good: it all landed
        assert receiver.pool.pages is not None

        async def verify():
            return await engine_answer(lambda done: harness.engine.verify(
                "nan", PROMPT, SamplingConfig(), done))

        with pytest.raises(HandoffRefused) as refused:
            asyncio.run(verify())
        assert refused.value.reason == "KV_NOT_FINITE"
        harness.engine.release("nan")
        assert harness.pages_free() == baseline
    finally:
        asyncio.run(receiver.close())


def test_a_quarantine_that_finds_no_free_pages_refuses_the_retry_until_pages_return(
        harness, receiver, peer):
    """Every other page is taken: the stalled READ's pages are quarantined and the request is
    left without pages, so its retry is refused RESOURCE_EXHAUSTED (nothing READ); once the READ
    ends the pool is at baseline."""
    baseline = harness.pages_free()
    free = baseline[0] - 3  # PROMPT's reservation takes 3 pages of 16 slots
    asyncio.run(engine_answer(lambda done: harness.engine.reserve("filler", free * 16, done)))
    nonce = new_nonce()
    frames, _ = _handoff(harness, peer, "cornered", nonce)
    peer.ask("stall")
    resumed = False
    try:
        err, _ = _run(harness, receiver, FakeClient(frames), "cornered", nonce)
        assert isinstance(err, HandoffRefused) and err.reason == "TRANSFER_TIMEOUT", err
        assert not harness.pool.allocator.holds("cornered")
        counters = receiver.quarantine.counters
        assert counters.get("nixl_quarantine_left_request_without_pages") == 1
        expect = Expectation("cornered", len(PROMPT), _layout(harness), FINGERPRINT, 4 << 20,
                             harness.model.config.vocab_size, nonce, prompt_digest(PROMPT))
        retry = handoff_pb2.PrefillRequest(request_id="cornered", token_ids=PROMPT, nonce=nonce)
        client = FakeClient(frames)
        receiver.client = client
        with pytest.raises(ServiceError) as refused:
            asyncio.run(receiver.receive(HandoffJob(retry, expect, SamplingConfig(), 30.0),
                                         TransferRecord("cornered", "nixl")))
        assert (refused.value.code, refused.value.reason) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED, "KV_PAGES_QUARANTINED")
        assert client.requests == []  # nothing asked of prefill, nothing READ
        peer.ask("resume")
        resumed = True
        _quarantine_over(receiver)
    finally:
        if not resumed:
            peer.ask("resume")
    harness.engine.release("cornered")
    harness.engine.release("filler")
    assert harness.pages_free() == baseline
