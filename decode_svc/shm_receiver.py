"""The shared-memory plane on decode: chunk frames carry references into a region prefill wrote
on this host; decode copies the bytes into its own memory FIRST, then the verifier checks the
frame (sizes, both 1.1 checksums) over that copy, exactly as inline. With a CPU pool the copy is
block by block straight into the request's own pages (decode_svc.page_landing: no staging buffer,
no engine write after it), one pread per 256 KiB block, each block's CRC-32C (the one the verifier
compares) and finiteness computed while it is in cache (decode_svc.inline_landing.land_blocks,
the inline plane's pass); otherwise the bytes land in a buffer of decode's own and go to the
engine's write path.

Invariants (besides KvReceiver's): bytes are read only from regions named "kvh-<32 hex>" in
decode's own shared-memory directory that pass shm_region's owner and mode checks; a reference
is bounded (length = the layout's size for its token range, at most max_chunk_bytes for K plus
V) before anything is read; a frame with both inline bytes and a reference is refused; every
region opened is closed and unlinked, and ReleaseHandoff sent, however the handoff ends
(decode_svc.oob_receiver); after a failed handoff, the region pools of dead prefills in the
directory are removed too.
"""

from __future__ import annotations


import numpy as np

from common.handoff.codec import WireChunk, WireChunkFrame
from common.handoff.planes import SHARED_MEMORY, host_identity
from common.handoff.reasons import refuse
from common.handoff.region_pool import sweep_dead_pools
from common.handoff.scattered import ScatteredBytes
from common.handoff.shm_region import RegionError, RegionReader
from common.handoff.transfer import TransferRecord
from common.handoff.verifier import Expectation, VerifiedChunk
from decode_svc.chunk_reference import reference_to_fetch
from decode_svc.engine import DecodeEngine
from decode_svc.handoff import write_chunk
from decode_svc.kv_receiver import HandoffJob, LandedKv
from decode_svc.oob_receiver import OutOfBandReceiver
from decode_svc.page_landing import PageLanding
from decode_svc.inline_landing import land_blocks
from decode_svc.payload_pass import checksummed
from decode_svc.prefill_client import PrefillClient

MAX_REGIONS_PER_HANDOFF = 4
# Bytes per pread of the landing pass: the best of 128 KiB .. 1 MiB in bench/shm_landing.py on
# this project's 2-core host (3-6% less CPU per chunk than 128 KiB; the pread dominates, and the
# block is still in L2 for the CRC and the finiteness check after it).
LANDING_BLOCK_BYTES = 256 << 10


class _Landing:
    """One handoff's open regions and the copy-out of each referenced chunk."""

    def __init__(self, directory: str, expect: Expectation, engine: DecodeEngine,
                 pages: PageLanding, one_pass: bool = True) -> None:
        self.directory = directory
        self.expect = expect
        self.engine = engine
        self.pages = pages
        self.one_pass = one_pass
        self.readers: dict[str, RegionReader] = {}
        self._finite: dict[tuple[int, int], bool] = {}  # (layer, token_start) -> all finite

    def resolve(self, frame):
        chunk = reference_to_fetch(frame, self.expect, "shared-memory")
        if chunk is None:
            return frame
        expect = self.expect
        if chunk.request_id != expect.request_id or not self.pages.in_range(
                chunk.layer, chunk.token_start, chunk.token_end, expect.token_count):
            return frame  # the verifier refuses its id or range; nothing read
        ref = chunk.ref
        reader = self._reader(ref.region)
        try:
            if self.pages.in_place:
                pieces = self.pages.pieces(expect.request_id, chunk.layer, chunk.token_start,
                                           chunk.token_end)
                k, v = pieces.k, pieces.v
                if self.one_pass:
                    check = land_blocks(_region_fill(reader, ref.k_offset),
                                        _region_fill(reader, ref.v_offset), k, v,
                                        expect.layout.dtype, LANDING_BLOCK_BYTES)
                    k, v = checksummed(k, v, check)
                    self._finite[(chunk.layer, chunk.token_start)] = check.finite
                else:
                    reader.scatter_into(ref.k_offset, k.pieces)
                    reader.scatter_into(ref.v_offset, v.pieces)
            else:
                flat = np.empty((2, ref.length), dtype=np.uint8)  # [2, length] decode's own
                reader.read_into(ref.k_offset, flat[0])
                reader.read_into(ref.v_offset, flat[1])
                k, v = flat[0], flat[1]
                k.flags.writeable = False
                v.flags.writeable = False
        except (RegionError, OSError) as err:
            raise refuse("REGION_INVALID", f"chunk {chunk.sequence_number}: {err}") from err
        return WireChunkFrame(WireChunk(
            request_id=chunk.request_id, sequence_number=chunk.sequence_number,
            layer=chunk.layer, token_start=chunk.token_start, token_end=chunk.token_end,
            k=k, v=v, crc32c=chunk.crc32c, nonce=bytes(chunk.nonce),
            chunk_crc32c=chunk.chunk_crc32c))

    def deliver(self, chunk: VerifiedChunk) -> None:
        """A verified chunk: already in the pages (nothing to tell the engine when the one pass
        found every value finite: its finiteness record of a request starts at "all finite", and
        a Landed of no pieces would only wake its thread; all its pieces otherwise, so the
        engine's own check refuses it exactly as before), or in decode's own buffer (the
        engine's write path)."""
        if isinstance(chunk.k, ScatteredBytes):
            if not self._finite.pop((chunk.layer, chunk.token_start), False):
                self.engine.landed(self.expect.request_id, chunk.k.pieces + chunk.v.pieces)
        else:
            write_chunk(self.engine, self.expect.request_id, chunk)

    def _reader(self, name: str) -> RegionReader:
        reader = self.readers.get(name)
        if reader is not None:
            return reader
        if len(self.readers) >= MAX_REGIONS_PER_HANDOFF:
            raise refuse("REGION_INVALID", f"the handoff refers to more than "
                         f"{MAX_REGIONS_PER_HANDOFF} regions")
        try:
            reader = RegionReader(self.directory, name)
        except RegionError as err:
            raise refuse("REGION_INVALID", str(err)) from err
        self.readers[name] = reader
        return reader

    def close(self) -> None:
        """Closes and unlinks every region this handoff opened: decode holds its own copy, and
        a prefill killed mid-transfer would otherwise leave them behind (D-65)."""
        for reader in self.readers.values():
            reader.close()
            reader.unlink()
        self.readers.clear()


def _region_fill(reader: RegionReader, offset: int):
    """fill(at, part) for land_blocks: the region's bytes [offset + at, + len(part)), one
    pread into part (decode's page), never a mapping (common.handoff.shm_region)."""
    def fill(at: int, part: np.ndarray) -> None:
        reader.read_into(offset + at, part)
    return fill


class SharedMemoryReceiver(OutOfBandReceiver):
    """one_pass: a chunk lands in the pages block by block, each block's CRC-32C and finiteness
    computed right after its pread (decode_svc.inline_landing.land_blocks); False: one preadv
    per side, then the verifier's CRC pass and the engine's finiteness pass (kept for the
    side-by-side bench)."""

    plane = SHARED_MEMORY

    def __init__(self, client: PrefillClient, engine: DecodeEngine, directory: str,
                 one_pass: bool = True) -> None:
        super().__init__(client, engine)
        self.directory = directory
        self.host_id = host_identity(directory)
        self.pages = PageLanding(engine.pool)
        self.one_pass = one_pass

    async def receive(self, job: HandoffJob, record: TransferRecord) -> LandedKv:
        request = self._request(job)
        request.data_plane_host_id = self.host_id
        landing = _Landing(self.directory, job.expect, self.engine, self.pages, self.one_pass)
        try:
            return await self._receive_through(landing, request, job, record, landing.deliver)
        except BaseException:
            # a prefill killed mid-transfer also leaves its region pool's directory: remove it
            # once no live process holds its lock (common.handoff.region_pool)
            sweep_dead_pools(self.directory)
            raise
