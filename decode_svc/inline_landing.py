"""The inline plane on decode with a CPU pool: a chunk's K and V, parsed without a copy out of
the received frame (common.handoff.codec.parse_chunk_fast), go straight into the request's own
pages in one block-interleaved pass that also computes the CRC-32C the verifier compares and the
finiteness check, each block read back from cache right after it was written. Before: the
verifier's CRC pass over the frame, then on the engine thread a finiteness pass over the frame
and the copy into the pages, three passes over every byte.

The checks run over the pages, the bytes decode will read (as on the shared-memory plane,
decode_svc.shm_receiver); the verifier's order is unchanged: it sees the chunk with
ChecksummedBytes (common.handoff.crc) and compares sizes, then the CRC, then the frame checksum,
exactly as for a chunk that carries its bytes. The pages are decode's own memory, reserved for
this request alone: a chunk that lands and is then refused only ever wrote pages that the
refusal frees (G-07), and nothing that landed is read before its Verify.

Invariants: only a canonical chunk (a WireChunkFrame) of this request whose layer and token range
lie inside the reservation and whose K and V are exactly the layout's size for that range is
landed; anything else reaches the verifier untouched (and is refused there, or, when protobuf
parsed it, written by the engine as before); the pass covers every byte with the CRC whatever
the finiteness answer.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from common.handoff.codec import WireChunkFrame
from common.handoff.scattered import ScatteredBytes
from common.handoff.verifier import Expectation, VerifiedChunk
from decode_svc.engine import DecodeEngine
from decode_svc.page_landing import PageLanding
from decode_svc.payload_pass import DEFAULT_BLOCK_BYTES, PayloadCheck, block_pass, checksummed


def land_payload(k: np.ndarray, v: np.ndarray, k_dest: ScatteredBytes, v_dest: ScatteredBytes,
                 dtype: torch.dtype, block_bytes: int = DEFAULT_BLOCK_BYTES) -> PayloadCheck:
    """Copies k into k_dest's pieces and v into v_dest's, in order (len(k) == len(k_dest),
    len(v) == len(v_dest); uint8, whole values of dtype), block by block; each block's CRC-32C
    and finiteness are computed over the block just written -> the same PayloadCheck that
    payload_pass.check_payload(k_dest, v_dest, dtype) would answer after the copy."""
    assert len(k) == len(k_dest) and len(v) == len(v_dest), (len(k), len(k_dest))
    return land_blocks(_copy_from(k), _copy_from(v), k_dest, v_dest, dtype, block_bytes)


def _copy_from(src: np.ndarray):
    def fill(at: int, part: np.ndarray) -> None:
        np.copyto(part, src[at:at + part.size])
    return fill


def land_blocks(fill_k, fill_v, k_dest: ScatteredBytes, v_dest: ScatteredBytes,
                dtype: torch.dtype, block_bytes: int = DEFAULT_BLOCK_BYTES) -> PayloadCheck:
    """The block pass of any plane that lands a chunk in decode's pages: for each block of
    k_dest's pieces, then of v_dest's (uint8 views of the pages, whole values of dtype),
    fill_k(at, part) / fill_v(at, part) writes the source's bytes [at, at + len(part)) into part
    (at counts from the side's first byte; a fill that cannot raises, and nothing is answered),
    then the block's CRC-32C and finiteness are computed over part while it is in cache -> the
    PayloadCheck that payload_pass.check_payload(k_dest, v_dest, dtype) answers after the copy.
    The CRC covers every byte whatever the finiteness answer (payload_pass.block_pass)."""
    return block_pass(((fill_k, k_dest.pieces), (fill_v, v_dest.pieces)), dtype, block_bytes)


class InlineLanding:
    """One handoff's resolve (before the verifier) and deliver (after it) hooks for
    decode_svc.handoff.receive_handoff. inline_only(frame): the inline plane's own frame check,
    run first on every frame; write(engine, request_id, chunk): the engine's write path, for a
    chunk that did not land (decode_svc.handoff passes both, its own)."""

    def __init__(self, expect: Expectation, engine: DecodeEngine, pages: PageLanding,
                 inline_only, write) -> None:
        self.expect = expect
        self.engine = engine
        self.pages = pages
        self.inline_only = inline_only
        self.write = write
        self._row = expect.layout.k_bytes_per_token_per_layer
        self._finite: dict[tuple[int, int], bool] = {}  # (layer, token_start) -> all finite

    def resolve(self, frame):
        frame = self.inline_only(frame)
        if not isinstance(frame, WireChunkFrame):
            return frame  # header, commit, or a chunk protobuf parsed: as before
        chunk = frame.chunk
        expect = self.expect
        size = (chunk.token_end - chunk.token_start) * self._row
        if (chunk.request_id != expect.request_id
                or not self.pages.in_range(chunk.layer, chunk.token_start, chunk.token_end,
                                           expect.token_count)
                or len(chunk.k) != size or len(chunk.v) != size):
            return frame  # the verifier refuses it; nothing landed
        pieces = self.pages.pieces(expect.request_id, chunk.layer, chunk.token_start,
                                   chunk.token_end)
        check = land_payload(chunk.k, chunk.v, pieces.k, pieces.v, expect.layout.dtype)
        self._finite[(chunk.layer, chunk.token_start)] = check.finite
        k, v = checksummed(pieces.k, pieces.v, check)
        return WireChunkFrame(replace(chunk, k=k, v=v))

    def deliver(self, chunk: VerifiedChunk) -> None:
        """A verified chunk already in the pages: nothing to tell the engine when the pass found
        every value finite (its finiteness record of a request starts at "all finite", and a
        Landed of no pieces would only wake its thread to keep it so); otherwise all its pieces,
        so the engine's own check refuses the handoff as before. Bytes protobuf parsed: the
        engine's write path."""
        if isinstance(chunk.k, ScatteredBytes):
            if not self._finite.pop((chunk.layer, chunk.token_start), False):
                self.engine.landed(self.expect.request_id, chunk.k.pieces + chunk.v.pieces)
        else:
            self.write(self.engine, self.expect.request_id, chunk)
