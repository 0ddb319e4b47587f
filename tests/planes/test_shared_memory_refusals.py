"""Decode's shared-memory receiver fails closed: the bytes it lands are its own copy, checked
with the 1.1 checksums; corrupt, missing, unsafe or short regions and a peer that dies
mid-transfer are refused, every region it opened is closed and unlinked, the pages come back;
prefill frees a region decode never releases once the grace period passes."""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest
import torch

from common.counters import Counters
from common.handoff.binding import new_nonce, prompt_digest
from common.handoff.codec import commit_frame, frame_wire, header_frame, parse_chunk_fast
from common.handoff.layout import KvLayout
from common.handoff.reasons import HandoffRefused
from common.handoff.transfer import TransferRecord, TransferState
from common.handoff.verifier import Expectation
from common.pb.kvhandoff.v1 import handoff_pb2
from common.sampling import SamplingConfig
from decode_svc.engine_answer import engine_answer
from decode_svc.kv_receiver import HandoffJob
from decode_svc.shm_receiver import SharedMemoryReceiver
from prefill_svc.handoff_leases import HandoffLeases
from prefill_svc.shm_sender import SharedMemorySender
from tests.isolation.inproc import Harness

PROMPT = list(range(3, 40))
FINGERPRINT = "fp"
CHUNK_TOKENS = 16  # 3 chunks per layer for 37 tokens


class FakeCall:
    """A Prefill call that yields prepared frames, then optionally fails as a dead peer."""

    def __init__(self, frames: list[bytes], die_after: int | None) -> None:
        self.frames = frames
        self.die_after = die_after
        self.cancelled = False

    def __aiter__(self):
        return self._frames()

    async def _frames(self):
        for i, data in enumerate(self.frames):
            if self.die_after is not None and i == self.die_after:
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                           grpc.aio.Metadata(), "Socket closed")
            yield parse_chunk_fast(data) or handoff_pb2.PrefillResponse.FromString(data)

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class FakeClient:
    def __init__(self, frames: list[bytes], die_after: int | None = None) -> None:
        self.call = FakeCall(frames, die_after)
        self.released: list[tuple[str, bytes]] = []
        self.requests: list[handoff_pb2.PrefillRequest] = []

    def prefill(self, request, timeout):
        self.requests.append(request)
        return self.call

    async def release(self, request_id, nonce, timeout):
        self.released.append((request_id, nonce))
        return True


def _layout(h: Harness) -> KvLayout:
    c = h.model.config
    return KvLayout(c.num_layers, c.num_kv_heads, c.head_dim, h.model.dtype)


def _handoff(h: Harness, shm, request_id: str, nonce: bytes):
    """Prefill's side: the frames of a good shared-memory handoff and its sender."""
    first, kv, _ = h.prefill(PROMPT)
    layout = _layout(h)
    sender = SharedMemorySender(request_id, layout, len(PROMPT), str(shm))
    frames = [frame_wire(header_frame(request_id, len(PROMPT), handoff_pb2.HANDOFF_STATUS_OK,
                                      layout, FINGERPRINT, nonce=nonce,
                                      digest=prompt_digest(PROMPT)))]
    seq = 0
    for layer, layer_kv in enumerate(kv):
        for start in range(0, len(PROMPT), CHUNK_TOKENS):
            part = layer_kv[:, start:start + CHUNK_TOKENS].contiguous()
            frames.append(sender.chunk(request_id, seq, layer, start, part, nonce))
            seq += 1
    frames.append(frame_wire(commit_frame(request_id, len(PROMPT), seq, first, nonce=nonce)))
    return frames, sender, kv


async def _receive(h: Harness, client: FakeClient, shm, request_id: str, nonce: bytes,
                   record: TransferRecord):
    await engine_answer(lambda done: h.engine.reserve(request_id, len(PROMPT), done))
    expect = Expectation(request_id, len(PROMPT), _layout(h), FINGERPRINT, 4 << 20,
                         h.model.config.vocab_size, nonce, prompt_digest(PROMPT))
    request = handoff_pb2.PrefillRequest(request_id=request_id, token_ids=PROMPT, nonce=nonce)
    receiver = SharedMemoryReceiver(client, h.engine, str(shm))
    try:
        return await receiver.receive(HandoffJob(request, expect, SamplingConfig(), 30.0),
                                      record)
    finally:
        await asyncio.sleep(0)  # let the release task run
        await asyncio.gather(*receiver._releases)


def _run(h, client, shm, request_id, nonce):
    record = TransferRecord(request_id, "shared-memory")
    try:
        return asyncio.run(_receive(h, client, shm, request_id, nonce, record)), record
    except HandoffRefused as err:
        return err, record


def _landed_kv(h: Harness, request_id: str) -> list[torch.Tensor]:
    h.drain()
    pool = h.pool
    table = torch.tensor(pool.allocator.page_table(request_id), dtype=torch.int32)
    return [h.model.ops.pack_kv(pool.k[layer], pool.v[layer], table, 0, len(PROMPT))
            for layer in range(h.model.config.num_layers)]


def test_a_good_handoff_lands_exactly_the_bytes_prefill_packed(harness, shm):
    baseline = harness.pages_free()
    nonce = new_nonce()
    frames, sender, kv = _handoff(harness, shm, "good", nonce)
    region = shm / sender.region_name
    assert oct(region.stat().st_mode & 0o777) == "0o600"
    client = FakeClient(frames)
    landed, record = _run(harness, client, shm, "good", nonce)
    assert record.state == TransferState.SUCCESS and not isinstance(landed, Exception)
    assert landed.payload_bytes == sum(t.numel() * t.element_size() for t in kv)
    for got, want in zip(_landed_kv(harness, "good"), kv, strict=True):
        assert torch.equal(got, want)
    assert client.requests[0].data_plane == handoff_pb2.DATA_PLANE_SHARED_MEMORY
    assert client.released == [("good", nonce)]
    assert not region.exists()  # decode unlinked what it read
    sender.release(True)  # prefill's own release after decode's is harmless
    harness.engine.release("good")
    assert harness.pages_free() == baseline


def _refused(harness, shm, frames, nonce, request_id, sender, die_after=None,
             decode_unlinks: bool = False) -> HandoffRefused:
    """Refused, FAILED, call ended, release sent, pages back; once prefill's own release ran
    too, no region is left (decode unlinks what it opened; it never touches one it refused)."""
    baseline = harness.pages_free()
    client = FakeClient(frames, die_after)
    err, record = _run(harness, client, shm, request_id, nonce)
    assert isinstance(err, HandoffRefused), err
    assert record.state == TransferState.FAILED and record.failure == err.reason
    assert client.call.cancelled and client.released == [(request_id, nonce)]
    harness.engine.release(request_id)
    assert harness.pages_free() == baseline
    if decode_unlinks:  # before prefill's own release: decode removed what it had opened
        assert list(shm.iterdir()) == []
    sender.release(False)
    assert list(shm.iterdir()) == []
    return err


def test_corrupt_landed_bytes_are_refused(harness, shm):
    nonce = new_nonce()
    frames, sender, _ = _handoff(harness, shm, "corrupt", nonce)
    path = shm / sender.region_name
    with open(path, "r+b") as f:  # one bit of layer 1's first chunk, after prefill wrote it
        f.seek(sender.size // 2 + 5)
        byte = f.read(1)
        f.seek(sender.size // 2 + 5)
        f.write(bytes([byte[0] ^ 0x10]))
    err = _refused(harness, shm, frames, nonce, "corrupt", sender)
    assert (err.reason, err.code) == ("CHECKSUM_MISMATCH", grpc.StatusCode.DATA_LOSS)


def test_a_reference_to_a_missing_region_is_refused(harness, shm):
    nonce = new_nonce()
    frames, sender, _ = _handoff(harness, shm, "missing", nonce)
    sender.release(False)  # the region is gone before decode reads it
    err = _refused(harness, shm, frames, nonce, "missing", sender)
    assert (err.reason, err.code) == ("REGION_INVALID", grpc.StatusCode.DATA_LOSS)
    assert "cannot be opened" in err.message


def test_a_region_others_may_read_is_refused(harness, shm):
    nonce = new_nonce()
    frames, sender, _ = _handoff(harness, shm, "open", nonce)
    os.chmod(shm / sender.region_name, 0o644)
    err = _refused(harness, shm, frames, nonce, "open", sender)
    assert err.reason == "REGION_INVALID" and "mode 644" in err.message


def test_a_region_shorter_than_its_references_is_refused(harness, shm):
    nonce = new_nonce()
    frames, sender, _ = _handoff(harness, shm, "short", nonce)
    os.truncate(shm / sender.region_name, sender.size // 3)
    err = _refused(harness, shm, frames, nonce, "short", sender)
    assert err.reason == "REGION_INVALID" and "ends before" in err.message


def test_a_name_outside_the_region_form_is_never_opened(harness, shm):
    nonce = new_nonce()
    frames, sender, _ = _handoff(harness, shm, "name", nonce)
    bad = handoff_pb2.PrefillResponse.FromString(frames[1])
    bad.chunk.ref.region = "../" + sender.region_name
    frames[1] = bad.SerializeToString()
    sender.release(False)
    err = _refused(harness, shm, frames, nonce, "name", sender)
    assert err.reason == "REGION_INVALID" and "not of the form" in err.message


def test_inline_bytes_and_a_reference_together_are_refused(harness, shm):
    nonce = new_nonce()
    frames, sender, _ = _handoff(harness, shm, "both", nonce)
    both = handoff_pb2.PrefillResponse.FromString(frames[1])
    both.chunk.k = b"\0" * both.chunk.ref.length
    frames[1] = both.SerializeToString()
    sender.release(False)
    err = _refused(harness, shm, frames, nonce, "both", sender)
    assert err.reason == "REFERENCE_UNEXPECTED"


def test_a_peer_killed_mid_transfer_is_refused_and_its_region_removed(harness, shm):
    nonce = new_nonce()
    frames, sender, _ = _handoff(harness, shm, "killed", nonce)
    err = _refused(harness, shm, frames, nonce, "killed", sender, die_after=3,
                   decode_unlinks=True)
    assert err.reason == "PEER_UNAVAILABLE"
    sender.release(False)


class Rewriting(FakeClient):
    """Runs on_frame(i) each time decode asks for frame i (frame i - 1 fully processed)."""

    def __init__(self, frames, on_frame) -> None:
        super().__init__(frames)
        self.on_frame = on_frame

    def prefill(self, request, timeout):
        call = super().prefill(request, timeout)
        inner = call._frames

        async def frames():
            i = 0
            self.on_frame(i)
            async for frame in inner():
                yield frame
                i += 1
                self.on_frame(i)
        call._frames = frames
        return call


def test_each_chunk_is_read_when_its_reference_arrives(harness, shm):
    """Bytes rewritten after chunk 0 was landed do not change chunk 0; chunk 1 is refused."""
    nonce = new_nonce()
    frames, sender, _ = _handoff(harness, shm, "rewrite", nonce)
    path = shm / sender.region_name
    size = path.stat().st_size

    def on_frame(i):
        if i == 2:  # header and chunk 0 processed
            path.write_bytes(bytes(size))

    err, record = _run(harness, Rewriting(frames, on_frame), shm, "rewrite", nonce)
    assert isinstance(err, HandoffRefused) and err.reason == "CHECKSUM_MISMATCH"
    assert err.message.startswith("chunk 1 ")
    harness.engine.release("rewrite")
    sender.release(False)


def test_decode_checks_and_keeps_its_own_copy_not_the_shared_source(harness, shm, monkeypatch):
    """Each chunk is read straight into decode's pages; the peer then zeroes the region (before
    the checksum check and for the rest of that chunk's processing) and restores it only for the
    next chunk's read: the handoff still verifies and what lands is prefill's KV, because the
    checks and the pages read decode's copy, never the region."""
    from common.handoff.shm_region import RegionReader

    nonce = new_nonce()
    frames, sender, kv = _handoff(harness, shm, "copy", nonce)
    path = shm / sender.region_name
    source = path.read_bytes()
    original = RegionReader.scatter_into
    reads = []

    def read_then_zeroed(self, offset, pieces):
        path.write_bytes(source)  # the bytes prefill wrote, for this read only
        try:
            return original(self, offset, pieces)
        finally:
            path.write_bytes(bytes(len(source)))  # zeros from here to the next read
            reads.append(offset)

    monkeypatch.setattr(RegionReader, "scatter_into", read_then_zeroed)
    landed, record = _run(harness, FakeClient(frames), shm, "copy", nonce)
    assert record.state == TransferState.SUCCESS, landed
    assert len(reads) == 2 * (len(frames) - 2)  # K and V of every chunk went through the hook
    got_kv = _landed_kv(harness, "copy")
    for got, want in zip(got_kv, kv, strict=True):
        assert torch.equal(got, want)
    harness.engine.release("copy")
    sender.release(True)


def test_a_release_that_never_comes_is_cleaned_up_after_the_grace_period(harness, shm):
    counters = Counters()
    nonce = new_nonce()
    frames, sender, _ = _handoff(harness, shm, "orphan", nonce)
    region = shm / sender.region_name

    async def scenario():
        leases = HandoffLeases(0.2, counters)
        leases.add("orphan", nonce, sender)
        leases.stream_ended("orphan", nonce, completed=True)
        assert region.exists() and leases.held() == 1
        await asyncio.sleep(0.1)
        assert region.exists()  # still pinned inside the grace period
        await asyncio.sleep(0.4)
        assert leases.held() == 0
        assert not leases.release("orphan", nonce)  # too late: nothing held, no error

    asyncio.run(scenario())
    assert not region.exists()
    assert counters.snapshot() == {"handoff_releases_expired": 1}
    assert sender.record.state == TransferState.SUCCESS


def test_only_the_right_nonce_releases(harness, shm):
    counters = Counters()
    nonce = new_nonce()
    _, sender, _ = _handoff(harness, shm, "owned", nonce)

    async def scenario():
        leases = HandoffLeases(30, counters)
        leases.add("owned", nonce, sender)
        assert not leases.release("owned", new_nonce())
        assert (shm / sender.region_name).exists()
        assert leases.release("owned", nonce)

    asyncio.run(scenario())
    assert list(shm.iterdir()) == [] and counters.snapshot() == {"handoff_releases": 1}


def test_a_nan_that_lands_in_the_pages_is_refused_at_verify_and_frees_them(harness, shm):
    """The region holds a NaN that prefill checksummed (so every frame passes): the landing reads
    it straight into the pages, the engine's finiteness check on those pages finds it, and the
    request is refused KV_NOT_FINITE with its pages back."""
    baseline = harness.pages_free()
    nonce = new_nonce()
    first, kv, _ = harness.prefill(PROMPT)
    kv[-1][1, -1, -1, -1] = float("nan")  # the last layer's V, last token
    layout = _layout(harness)
    sender = SharedMemorySender("nan", layout, len(PROMPT), str(shm))
    frames = [frame_wire(header_frame("nan", len(PROMPT), handoff_pb2.HANDOFF_STATUS_OK, layout,
                                      FINGERPRINT, nonce=nonce, digest=prompt_digest(PROMPT)))]
    seq = 0
    for layer, layer_kv in enumerate(kv):
        for start in range(0, len(PROMPT), CHUNK_TOKENS):
            frames.append(sender.chunk("nan", seq, layer, start,
                                       layer_kv[:, start:start + CHUNK_TOKENS].contiguous(), nonce))
            seq += 1
    frames.append(frame_wire(commit_frame("nan", len(PROMPT), seq, first, nonce=nonce)))
    landed, record = _run(harness, FakeClient(frames), shm, "nan", nonce)
    assert record.state == TransferState.SUCCESS, landed  # the form is good: it all landed

    async def verify():
        return await engine_answer(lambda done: harness.engine.verify(
            "nan", PROMPT, SamplingConfig(), done))

    with pytest.raises(HandoffRefused) as refused:
        asyncio.run(verify())
    assert refused.value.reason == "KV_NOT_FINITE"
    harness.engine.release("nan")
    harness.drain()
    sender.release(False)
    assert harness.pages_free() == baseline
