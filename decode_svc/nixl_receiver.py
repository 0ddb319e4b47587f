"""The NIXL plane on decode: chunk frames carry references into memory prefill registered with
its NIXL agent; decode READs the bytes (a one-sided transfer decode initiates) and the verifier
checks sizes and both 1.1 checksums over what landed.

Where it lands (said once in the log, `nixl_landing`): with a CPU pool, straight into the
request's own pages (decode_svc.page_landing: one descriptor per run of contiguous page slots of
the chunk's K, and of its V), registered with decode's OWN agent and never described to a peer
(prefill never writes into decode: decode initiates every READ); the CRC-32C and the
finiteness check then run over the pages in one block-interleaved pass (decode_svc.payload_pass,
as on the shared-memory plane), the verifier compares that CRC, and no engine write follows.
Elsewhere (a GPU pool) into a staging buffer of decode's own holding the whole handoff
(each chunk at its own offset), which the engine's queued writes read in place; it goes back to
the pool only after those writes ran (an engine AfterWrites command).

Invariants (besides KvReceiver's):
- a reference is bounded before anything is read: length = the layout's size for its token
  range, K plus V at most max_chunk_bytes, both pieces inside the buffer the handoff's first
  reference described (its partial agent metadata), at most MAX_BUFFERS_PER_HANDOFF buffers,
  and (into pages) a layer and token range inside the reservation;
- a READ that fails is refused (TRANSFER_FAILED), one that is not DONE by the deadline (the
  sooner of read_timeout_s and the handoff's budget) is refused (TRANSFER_TIMEOUT);
- memory a READ may still write is never handed to another use: pages of a READ that did not
  end DONE are quarantined until NIXL says the transfer is over (decode_svc.nixl_quarantine,
  SPEC D-67a), the request getting fresh pages; a staging buffer is reused only after every
  READ into it was DONE and every engine write from it ran, else quarantined for good;
- ReleaseHandoff is sent however the handoff ends (off the request's path).
"""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np

from common.config import DecodeConfig
from common.counters import Counters
from common.errors import ServiceError
from common.handoff.codec import WireChunk, WireChunkFrame
from common.handoff.nixl_agent import DONE, IN_FLIGHT, NixlAgent, Registration, open_agent
from common.handoff.nixl_buffers import RegisteredBuffers
from common.handoff.planes import NIXL
from common.handoff.reasons import refuse
from common.handoff.scattered import ScatteredBytes
from common.handoff.transfer import TransferRecord
from common.handoff.verifier import Expectation, VerifiedChunk
from common.server.loopback import is_loopback_target
from common.pb.kvhandoff.v1 import handoff_pb2
from decode_svc.chunk_reference import reference_to_fetch
from decode_svc.engine import DecodeEngine
from decode_svc.handoff import handoff_budget, write_chunk
from decode_svc.kv_receiver import HandoffJob, KvReceiver, LandedKv
from decode_svc.nixl_pool import PoolRegistration
from decode_svc.nixl_quarantine import ReadQuarantine
from decode_svc.oob_receiver import OutOfBandReceiver
from decode_svc.payload_pass import check_payload, checksummed
from decode_svc.prefill_client import PrefillClient

MAX_BUFFERS_PER_HANDOFF = 4
DEFAULT_READ_TIMEOUT_S = 5.0
# Each handoff's buffer metadata adds a section to decode's view of the peer agent, and NIXL's
# lookups slow down with their number (measured: a 1 MiB load+READ took 0.5 ms after 10 loads,
# 4.4 ms after 3000); a peer is unloaded (and reconnected on its next handoff, ~2-6 ms) once
# it has this many sections and no handoff is using it.
MAX_SECTIONS_PER_PEER = 256
# NIXL keeps the first remote descriptor it loaded for a memory range and ignores a later
# identical one (nixlRemoteSection::addDescList), so after prefill deregistered and registered
# the same range again (P-68's pages, a packed buffer freed and reallocated) the loaded section
# may name a registration that no longer exists (its RDMA rkey invalid). A buffer metadata blob
# the peer never sent before, arriving while no handoff uses the peer, therefore drops the
# peer's earlier sections first (reconnect measured on loopback: ~0.3 ms load, ~0.5 ms more on
# the first READ); repeated blobs (a packed buffer reused) load as before.
SPIN_POLLS = 200  # polls without sleeping before backing off (a loopback READ takes < 1 ms)
POLL_PAUSE_S = 2e-4


class StagingPool:
    """decode's registered landing buffers (never shared with a peer), handed out one per
    handoff and returned after it; a buffer a READ may still write into is quarantined instead
    (never handed out again)."""

    def __init__(self, agent: NixlAgent, counters: Counters) -> None:
        self.agent = agent
        self.counters = counters
        self._buffers = RegisteredBuffers(agent, share=False)
        self.quarantined: list[tuple[np.ndarray, Registration]] = []

    def acquire(self, size: int) -> tuple[np.ndarray, Registration]:
        """-> a buffer of at least size bytes (decode's own memory) and its registration."""
        return self._buffers.acquire(size)

    def give_back(self, staging: tuple[np.ndarray, Registration]) -> None:
        self._buffers.give_back(*staging)

    def quarantine(self, staging: tuple[np.ndarray, Registration]) -> None:
        self.quarantined.append(staging)
        self.counters.add("nixl_buffers_quarantined")

    def in_use_by(self, buf: np.ndarray) -> bool:
        return any(b is buf for b, _ in self.quarantined)


class _Landing:
    """One handoff's buffers (by prefill address) and the READ of each referenced chunk."""

    def __init__(self, receiver: NixlReceiver, expect: Expectation, deadline: float) -> None:
        self.receiver = receiver
        self.expect = expect
        self.deadline = deadline
        self.pages = receiver.pool.pages  # None: the staging path
        self.buffers: dict[int, tuple[str, int]] = {}  # prefill address -> (peer agent, size)
        self.peers: set[str] = set()
        self.staging: tuple[np.ndarray, Registration] | None = None
        self.cursor = 0  # where the next chunk lands in the staging buffer
        self.tainted = False
        self._finite: dict[tuple[int, int], bool] = {}  # (layer, token_start) -> all finite

    async def resolve(self, frame):
        chunk = reference_to_fetch(frame, self.expect, "NIXL")
        if chunk is None:
            return frame
        expect, ref, seq = self.expect, chunk.ref, chunk.sequence_number
        if self.pages is not None and (chunk.request_id != expect.request_id
                                       or not self.pages.in_range(chunk.layer, chunk.token_start,
                                                                  chunk.token_end,
                                                                  expect.token_count)):
            return frame  # the verifier refuses its id or range; nothing read
        peer = self._buffer(seq, ref)
        k_at, v_at = ref.nixl_address + ref.k_offset, ref.nixl_address + ref.v_offset
        if self.pages is not None:
            pieces = self.pages.pieces(expect.request_id, chunk.layer, chunk.token_start,
                                       chunk.token_end)
            k, v = pieces.k, pieces.v  # ScatteredBytes: views of the pages
            local, remote = _descriptors(((k_at, k), (v_at, v)))
            await self._read(seq, lambda agent: agent.read_pieces(local, remote, peer), True)
            if self.receiver.one_pass:  # CRC-32C and finiteness in one pass over the pages
                check = check_payload(k, v, expect.layout.dtype)
                k, v = checksummed(k, v, check)
                self._finite[(chunk.layer, chunk.token_start)] = check.finite
        else:
            staging = self._own()
            if self.cursor + 2 * ref.length > staging.nbytes:
                raise refuse("REGION_INVALID", f"chunk {seq} refers to more bytes than the "
                             "handoff's KV holds")
            # [2, length] bytes of its own in the staging buffer: the engine's queued write of
            # this chunk reads them there while later chunks land further on
            own = staging[self.cursor:self.cursor + 2 * ref.length].reshape(2, ref.length)
            self.cursor += 2 * ref.length
            await self._read(seq, lambda agent: agent.read(
                own, [(k_at, ref.length), (v_at, ref.length)], peer), False)
            k, v = own[0], own[1]
            k.flags.writeable = False
            v.flags.writeable = False
        return WireChunkFrame(WireChunk(
            request_id=chunk.request_id, sequence_number=seq,
            layer=chunk.layer, token_start=chunk.token_start, token_end=chunk.token_end,
            k=k, v=v, crc32c=chunk.crc32c, nonce=bytes(chunk.nonce),
            chunk_crc32c=chunk.chunk_crc32c))

    def deliver(self, chunk: VerifiedChunk) -> None:
        """A verified chunk: already in the pages, or in the staging buffer (the engine's write
        path). In the pages: nothing to tell the engine when the one pass found every value
        finite (its finiteness record of a request starts at "all finite", and a Landed of no
        pieces would only wake its thread, as on the inline and shared-memory planes); all its
        pieces otherwise (the two-pass mode included), so the engine's own check refuses the
        handoff exactly as before."""
        if isinstance(chunk.k, ScatteredBytes):
            if not self._finite.pop((chunk.layer, chunk.token_start), False):
                self.receiver.engine.landed(self.expect.request_id,
                                            chunk.k.pieces + chunk.v.pieces)
        else:
            write_chunk(self.receiver.engine, self.expect.request_id, chunk)

    def _buffer(self, seq: int, ref: handoff_pb2.KvRegionRef) -> str:
        """-> the peer agent holding the buffer ref names, after the bounds checks."""
        size = ref.nixl_buffer_size
        if not ref.nixl_address or not size or ref.nixl_address + size >= 2**64:
            raise refuse("REGION_INVALID", f"chunk {seq} carries no NIXL buffer reference")
        if max(ref.k_offset, ref.v_offset) + ref.length > size:
            raise refuse("REGION_INVALID", f"chunk {seq} refers past the end of its "
                         f"{size}-byte buffer")
        known = self.buffers.get(ref.nixl_address)
        if ref.nixl_buffer_metadata:
            if known is None and len(self.buffers) >= MAX_BUFFERS_PER_HANDOFF:
                raise refuse("REGION_INVALID", f"the handoff refers to more than "
                             f"{MAX_BUFFERS_PER_HANDOFF} NIXL buffers")
            try:
                peer = self.receiver.load_peer(bytes(ref.nixl_buffer_metadata))
            except Exception as err:  # a backend error: prefill's agent cannot be reached
                reason = ("TRANSFER_FAILED" if "Backend" in type(err).__name__
                          else "REGION_INVALID")
                raise refuse(reason, f"chunk {seq}: prefill's NIXL buffer metadata does not "
                             f"load: {type(err).__name__}") from err
            known = self.buffers[ref.nixl_address] = (peer, size)
            if peer not in self.peers:
                self.peers.add(peer)
                self.receiver.use_peer(peer)
        if known is None or known[1] != size:
            raise refuse("REGION_INVALID", f"chunk {seq} refers to a NIXL buffer no earlier "
                         "chunk of the handoff described")
        return known[0]

    def _own(self) -> np.ndarray:
        if self.staging is None:
            size = self.expect.token_count * self.expect.layout.kv_bytes_per_token
            self.staging = self.receiver.staging.acquire(size)
        return self.staging[0]

    async def _read(self, seq: int, post, into_pages: bool) -> None:
        """post(agent) -> (handle, state); waits for DONE by the deadline. A READ into pages
        that did not end DONE quarantines them (with its handle, still unreleased); into the
        staging buffer, it taints the buffer."""
        receiver = self.receiver
        agent = receiver.agent
        deadline = min(self.deadline, time.monotonic() + receiver.read_timeout_s)
        try:
            handle, state = post(agent)
        except Exception as err:  # refused before anything was posted: nothing in flight
            raise refuse("TRANSFER_FAILED", f"chunk {seq}: the NIXL READ could not be posted: "
                         f"{type(err).__name__}: {err}") from err
        polls = 0
        try:
            while state == IN_FLIGHT and time.monotonic() < deadline:
                polls += 1
                await asyncio.sleep(0 if polls < SPIN_POLLS else POLL_PAUSE_S)
                state = agent.state(handle)
        except BaseException:  # cancelled (the client left) mid-READ: it may still land
            self._withdraw(handle, into_pages)
            raise
        if state == DONE:
            agent.release(handle)
            return
        # failed or still in flight: bytes may yet land where the READ points
        self._withdraw(handle, into_pages)
        if state == IN_FLIGHT:
            raise refuse("TRANSFER_TIMEOUT", f"chunk {seq}: the NIXL READ did not complete "
                         f"within {receiver.read_timeout_s:.1f}s")
        raise refuse("TRANSFER_FAILED", f"chunk {seq}: the NIXL READ failed (prefill gone?)")

    def _withdraw(self, handle, into_pages: bool) -> None:
        if into_pages:
            self.receiver.quarantine.hold(self.receiver.engine, self.expect.request_id, handle)
        else:
            self.tainted = True
            self.receiver.agent.release(handle)

    def close(self) -> None:
        for peer in self.peers:
            self.receiver.unload_peer(peer)
        self.peers.clear()
        if self.staging is not None:
            staging, self.staging = self.staging, None
            if self.tainted:
                self.receiver.staging.quarantine(staging)
            else:  # after the engine's writes from it, queued before this
                pool = self.receiver.staging
                self.receiver.engine.after_writes(lambda: pool.give_back(staging))


def _descriptors(spans) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """spans: (remote address, ScatteredBytes of the pages) for K, then V -> the READ's local
    pieces (one per run of contiguous page slots) and the remote pieces they pair with."""
    local, remote = [], []
    for at, data in spans:
        for piece in data.pieces:
            local.append((piece.ctypes.data, piece.nbytes))
            remote.append((at, piece.nbytes))
            at += piece.nbytes
    return local, remote


class NixlReceiver(OutOfBandReceiver):
    plane = NIXL

    def __init__(self, client: PrefillClient, engine: DecodeEngine, agent: NixlAgent,
                 counters: Counters | None = None,
                 read_timeout_s: float = DEFAULT_READ_TIMEOUT_S, into_pages: bool = True,
                 log=None, one_pass: bool = True) -> None:
        super().__init__(client, engine)
        self.one_pass = one_pass  # False: the verifier's CRC pass, then the engine's finiteness
        self.agent = agent
        self.read_timeout_s = read_timeout_s
        counters = counters if counters is not None else Counters()
        self.staging = StagingPool(agent, counters)
        self.quarantine = ReadQuarantine(agent, counters)
        self.pool = PoolRegistration(agent, into_pages, log)
        self._sections: dict[str, int] = {}  # peer agent -> buffer metadata loaded since added
        self._users: dict[str, int] = {}  # peer agent -> handoffs using it now
        self._blobs: dict[str, set[bytes]] = {}  # peer agent -> metadata loaded since added

    def load_peer(self, metadata: bytes) -> str:
        """Loads one buffer's metadata (with the peer's connection info) -> the peer's name."""
        peer = self.agent.add_remote(metadata)
        seen = self._blobs.setdefault(peer, set())
        if metadata not in seen and seen and not self._users.get(peer, 0):
            self._drop_peer(peer)  # its sections may name registrations since dropped
            peer = self.agent.add_remote(metadata)
            seen = self._blobs.setdefault(peer, set())
        seen.add(metadata)
        self._sections[peer] = self._sections.get(peer, 0) + 1
        return peer

    def use_peer(self, peer: str) -> None:
        """A handoff starts reading from peer (once per handoff and peer)."""
        self._users[peer] = self._users.get(peer, 0) + 1

    def unload_peer(self, peer: str) -> None:
        """A handoff is done with peer; drops it from the agent once it holds too many
        sections and nobody uses it (see MAX_SECTIONS_PER_PEER)."""
        self._users[peer] -= 1
        if self._users[peer] == 0 and self._sections.get(peer, 0) >= MAX_SECTIONS_PER_PEER:
            self._drop_peer(peer)

    def _drop_peer(self, peer: str) -> None:
        """Unloads peer (no handoff uses it); its next metadata reconnects it."""
        try:
            self.agent.remove_remote(peer)
        except Exception:  # already gone: nothing to unload
            pass
        for known in (self._sections, self._users, self._blobs):
            known.pop(peer, None)

    async def receive(self, job: HandoffJob, record: TransferRecord) -> LandedKv:
        self.pool.register(self.engine.pool)
        if self.pool.pages is not None and not self.engine.pool.allocator.holds(
                job.expect.request_id):  # a quarantine found no fresh pages for it
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, "KV_PAGES_QUARANTINED",
                               "decode's KV pages for this request are quarantined behind a "
                               "NIXL READ that did not finish and no others are free; retry")
        landing = _Landing(self, job.expect, time.monotonic() + handoff_budget(job.timeout_s))
        return await self._receive_through(landing, self._request(job), job, record,
                                           landing.deliver)

    async def close(self) -> None:
        """Stops the quarantine's watcher; deregisters the pool unless a READ may still land."""
        self.quarantine.close()
        if not self.quarantine.held_pages:
            self.pool.close()


def nixl_receivers(config: DecodeConfig, client: PrefillClient, engine: DecodeEngine,
                   counters: Counters, log) -> dict[str, KvReceiver]:
    """{NIXL: receiver} when decode may use the plane (--data-plane auto or nixl, and no TLS
    unless --allow-planes-without-tls) and its agent starts; {} otherwise (D-67)."""
    svc = config.service
    if config.data_plane not in ("auto", NIXL) or config.local_prefill:
        return {}
    if svc.tls_cert and not svc.allow_planes_without_tls:
        return {}
    agent, why = open_agent("decode", is_loopback_target(config.prefill_target))
    if agent is None:
        log.info("nixl_unavailable", message=f"decode does not use the NIXL plane: {why}")
        return {}
    receiver = NixlReceiver(client, engine, agent, counters, config.nixl_read_timeout_s,
                            log=log)
    receiver.pool.register(engine.pool)  # logs which path the plane lands through
    return {NIXL: receiver}
