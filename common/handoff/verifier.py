"""Decode's check of a handoff, frame by frame. Fails closed: anything not exactly what was
asked for raises HandoffRefused, and only `finish` can declare a handoff complete.

States: AWAIT_HEADER -> RECEIVING -> COMMITTED; any refusal -> REFUSED (terminal).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


from common.handoff.crc import payload_crc32c
from common.handoff.binding import chunk_checksum, chunk_metadata, commit_checksum
from common.handoff.layout import (DEFAULT_MAX_CHUNK_BYTES, PROTOCOL_MAJOR, PROTOCOL_MINOR_BOUND,
                                   PROTOCOL_MINOR_CACHED, KvLayout, describe_layout)
from common.handoff.reasons import REJECTION_CODES, HandoffRefused, refuse
from common.pb.kvhandoff.v1 import handoff_pb2

OK = handoff_pb2.HANDOFF_STATUS_OK
REJECTED = handoff_pb2.HANDOFF_STATUS_REJECTED
ABORTED = handoff_pb2.HANDOFF_STATUS_ABORTED


class HandoffState(enum.Enum):
    AWAIT_HEADER = "await_header"
    RECEIVING = "receiving"
    COMMITTED = "committed"
    REFUSED = "refused"


@dataclass(frozen=True)
class Expectation:
    """What decode asked for: the verifier accepts nothing else."""

    request_id: str
    token_count: int
    layout: KvLayout
    model_fingerprint: str
    max_chunk_bytes: int  # as sent in the PrefillRequest; 0 means DEFAULT_MAX_CHUNK_BYTES
    vocab_size: int
    nonce: bytes = b""  # as sent in the PrefillRequest
    prompt_digest: bytes = b""  # binding.prompt_digest of the prompt sent
    allow_protocol_1_0: bool = False  # accept an unbound (1.0) handoff: no nonce, no checksums
    # the page size prefill's cache counts in (D-90: a commit's cached_tokens is a whole number
    # of them); 0: only the range is checked
    cache_page_size: int = 0


def carried_sizes(chunk) -> tuple[int, int]:
    """The K and V sizes a chunk frame claims: its bytes, or for an out-of-band reference that
    decode left unread (it was out of bounds, D-62), the size the reference names."""
    if (not len(chunk.k) and not len(chunk.v) and isinstance(chunk, handoff_pb2.KvChunk)
            and chunk.HasField("ref")):
        return chunk.ref.length, chunk.ref.length
    return len(chunk.k), len(chunk.v)


@dataclass(frozen=True)
class VerifiedChunk:
    layer: int
    token_start: int
    token_end: int
    k: bytes
    v: bytes


class HandoffVerifier:
    def __init__(self, expect: Expectation) -> None:
        self.expect = expect
        self.state = HandoffState.AWAIT_HEADER
        self.chunks_seen = 0
        self.tokens_covered = 0
        self._coverage = [bytearray(expect.token_count) for _ in range(expect.layout.num_layers)]
        self.first_token_id: int | None = None
        self.bound = True  # False once a 1.0 header was accepted: no binding fields to check
        self.minor = 0  # the header's minor version
        # prompt tokens prefill served from its prefix cache (1.2 commits, D-90; else 0); set
        # only on a verified commit: 0 <= cached_tokens < token_count, a whole number of pages
        self.cached_tokens = 0

    def _fail(self, reason: str, message: str, code=None) -> HandoffRefused:
        self.state = HandoffState.REFUSED
        return refuse(reason, message, code)

    def _check_request_id(self, frame_name: str, request_id: str) -> None:
        if request_id != self.expect.request_id:
            raise self._fail("REQUEST_ID_MISMATCH",
                             f"{frame_name} names request {request_id!r}, "
                             f"expected {self.expect.request_id!r}")

    def _check_status(self, frame_name: str, status: int, reason: str, reason_code: str) -> None:
        if status == OK:
            return
        if status == REJECTED:
            code = REJECTION_CODES.get(reason_code)
            refusal = self._fail("PEER_REJECTED", f"prefill rejected the prompt "
                                 f"({reason_code or 'no code'}): {reason or 'no reason given'}",
                                 code)
            if reason_code:
                refusal.metadata["peer_reason"] = reason_code[:64]
            raise refusal
        if status == ABORTED:
            raise self._fail("PEER_ABORTED",
                             f"prefill aborted the handoff: {reason or 'no reason'}")
        known = status in handoff_pb2.HandoffStatus.values()
        name = handoff_pb2.HandoffStatus.Name(status) if known else str(status)
        raise self._fail("STATUS_UNSPECIFIED", f"{frame_name} status is {name}, not OK")

    def on_frame(self, frame: handoff_pb2.PrefillResponse) -> VerifiedChunk | None:
        """Checks one parsed frame; returns the chunk to write when it is a verified chunk. (A
        frame that does not parse never gets here: decode's frame parser refuses it as
        FRAME_MALFORMED, `decode_svc.prefill_client.parse_frame`.)"""
        if self.state == HandoffState.REFUSED:
            raise refuse("FRAME_AFTER_COMMIT", "frame after the handoff was refused")
        kind = frame.WhichOneof("frame")
        if kind is None:
            raise self._fail("FRAME_EMPTY", "a frame carries neither header, chunk nor commit")
        if self.state == HandoffState.COMMITTED:
            raise self._fail("FRAME_AFTER_COMMIT", f"a {kind} arrived after the commit")
        if kind == "header":
            self._on_header(frame.header)
            return None
        if self.state == HandoffState.AWAIT_HEADER:
            raise self._fail("HEADER_MISSING", f"a {kind} arrived before the header")
        if kind == "chunk":
            return self._on_chunk(frame.chunk)
        self._on_commit(frame.commit)
        return None

    def _on_header(self, header: handoff_pb2.HandoffHeader) -> None:
        if self.state != HandoffState.AWAIT_HEADER:
            raise self._fail("HEADER_DUPLICATE", "a second header arrived")
        self._check_request_id("header", header.request_id)
        if header.protocol_version.major != PROTOCOL_MAJOR:
            raise self._fail("VERSION_UNSUPPORTED", f"protocol major version "
                             f"{header.protocol_version.major}; this decode speaks "
                             f"{PROTOCOL_MAJOR}")
        self._check_status("header", header.status, header.reason, header.reason_code)
        self.minor = header.protocol_version.minor
        if header.token_count != self.expect.token_count:
            raise self._fail("TOKEN_COUNT_MISMATCH", f"header token count {header.token_count}, "
                             f"but the prompt sent has {self.expect.token_count} tokens")
        self._check_header_binding(header)
        if header.model_fingerprint != self.expect.model_fingerprint:
            raise self._fail("MODEL_MISMATCH", f"prefill model {header.model_fingerprint!r} is not "
                             f"this decode's {self.expect.model_fingerprint!r}")
        if not self.expect.layout.matches(header.layout):
            raise self._fail("LAYOUT_MISMATCH", f"prefill KV layout "
                             f"{describe_layout(header.layout)} is not this decode's "
                             f"{describe_layout(self.expect.layout.to_proto())}")
        self.state = HandoffState.RECEIVING

    def _check_header_binding(self, header: handoff_pb2.HandoffHeader) -> None:
        """1.1: the nonce echoed and the digest of the prompt prefill computed (D-41, D-42);
        a 1.0 header only when the operator allowed it (D-44)."""
        if header.protocol_version.minor < PROTOCOL_MINOR_BOUND:
            if not self.expect.allow_protocol_1_0:
                raise self._fail("VERSION_UNSUPPORTED", "prefill answered with protocol "
                                 f"1.{header.protocol_version.minor}, which does not bind a "
                                 "handoff to its prompt; this decode requires 1.1 (start it with "
                                 "--allow-protocol-1-0 to accept 1.0 prefills)")
            self.bound = False
            return
        self._check_nonce("header", header.nonce)
        if header.prompt_digest != self.expect.prompt_digest:
            raise self._fail("PROMPT_DIGEST_MISMATCH", "the header's prompt digest "
                             f"{header.prompt_digest.hex()[:16] or 'empty'}... is not the digest "
                             "of the prompt decode sent: prefill computed other tokens")

    def _check_nonce(self, frame_name: str, nonce: bytes) -> None:
        if self.bound and nonce != self.expect.nonce:
            raise self._fail("NONCE_MISMATCH", f"{frame_name} carries nonce "
                             f"{bytes(nonce).hex() or 'empty'}, not this handoff's: a frame of "
                             "another handoff")

    def _on_chunk(self, chunk: handoff_pb2.KvChunk) -> VerifiedChunk:
        self._check_request_id("chunk", chunk.request_id)
        self._check_nonce("chunk", chunk.nonce)
        if chunk.sequence_number != self.chunks_seen:
            raise self._fail("CHUNK_SEQUENCE_GAP", f"chunk sequence number "
                             f"{chunk.sequence_number}, expected {self.chunks_seen}")
        layout = self.expect.layout
        if chunk.layer >= layout.num_layers:
            raise self._fail("CHUNK_LAYER_OUT_OF_RANGE",
                             f"chunk for layer {chunk.layer}; the model has {layout.num_layers}")
        start, end = chunk.token_start, chunk.token_end
        if not start < end <= self.expect.token_count:
            raise self._fail("CHUNK_RANGE_INVALID", f"chunk token range [{start}, {end}) is not "
                             f"inside [0, {self.expect.token_count})")
        k_size, v_size = carried_sizes(chunk)
        payload = k_size + v_size
        limit = self.expect.max_chunk_bytes or DEFAULT_MAX_CHUNK_BYTES  # 0: the default
        if payload > limit:
            raise self._fail("FRAME_TOO_LARGE", f"chunk payload {payload} bytes exceeds the "
                             f"negotiated maximum {limit}")
        expected = (end - start) * layout.k_bytes_per_token_per_layer
        if k_size != expected or v_size != expected:
            raise self._fail("CHUNK_SIZE_MISMATCH", f"chunk K/V are {k_size}/{v_size} "
                             f"bytes; the layout needs {expected} for {end - start} tokens")
        coverage = self._coverage[chunk.layer]
        if coverage.find(1, start, end) != -1:
            raise self._fail("CHUNK_OVERLAP", f"layer {chunk.layer} tokens [{start}, {end}) "
                             f"overlap a chunk already received")
        crc = payload_crc32c(chunk.k, chunk.v)
        if crc != chunk.crc32c:
            raise self._fail("CHECKSUM_MISMATCH", f"chunk {chunk.sequence_number} crc32c "
                             f"{chunk.crc32c:#010x}, computed {crc:#010x}")
        if self.bound:
            meta = chunk_metadata(chunk.request_id, self.expect.nonce, chunk.sequence_number,
                                  chunk.layer, start, end)
            frame_crc = chunk_checksum(crc, meta)
            if frame_crc != chunk.chunk_crc32c:
                raise self._fail("FRAME_CHECKSUM_MISMATCH", f"chunk {chunk.sequence_number} "
                                 f"checksum over metadata and payload is {chunk.chunk_crc32c:#010x}"
                                 f", computed {frame_crc:#010x}: its layer, range or sequence "
                                 "number is not the one it was sent with")
        coverage[start:end] = b"\x01" * (end - start)
        self.chunks_seen += 1
        self.tokens_covered += end - start
        return VerifiedChunk(chunk.layer, start, end, chunk.k, chunk.v)

    def _on_commit(self, commit: handoff_pb2.HandoffCommit) -> None:
        self._check_request_id("commit", commit.request_id)
        self._check_nonce("commit", commit.nonce)
        if self.bound:
            crc = commit_checksum(commit.request_id, self.expect.nonce, commit.token_count,
                                  commit.chunk_count, commit.first_token_id, commit.status,
                                  commit.cached_tokens)
            if crc != commit.commit_crc32c:
                raise self._fail("FRAME_CHECKSUM_MISMATCH", f"commit checksum "
                                 f"{commit.commit_crc32c:#010x}, computed {crc:#010x}: its "
                                 "counts, status, first token or cached count were changed")
        self._check_status("commit", commit.status, commit.reason, "")
        if commit.token_count != self.expect.token_count:
            raise self._fail("COMMIT_MISMATCH", f"commit token count {commit.token_count}, "
                             f"expected {self.expect.token_count}")
        if commit.chunk_count != self.chunks_seen:
            raise self._fail("COMMIT_MISMATCH", f"commit counts {commit.chunk_count} chunks, "
                             f"{self.chunks_seen} arrived")
        needed = self.expect.token_count * self.expect.layout.num_layers
        if self.tokens_covered != needed:
            raise self._fail("COVERAGE_INCOMPLETE", f"chunks cover {self.tokens_covered} of "
                             f"{needed} layer-tokens")
        if commit.first_token_id >= self.expect.vocab_size:
            raise self._fail("FIRST_TOKEN_INVALID", f"first token {commit.first_token_id} is "
                             f"outside the vocabulary of {self.expect.vocab_size}")
        self.cached_tokens = self._cached_tokens(commit.cached_tokens)
        self.first_token_id = commit.first_token_id
        self.state = HandoffState.COMMITTED

    def _cached_tokens(self, cached: int) -> int:
        """D-90: the commit's count of prompt tokens served from prefill's cache, bounded; a
        header of minor < 2 (which has no such field) means 0, whatever the commit holds."""
        if self.minor < PROTOCOL_MINOR_CACHED:
            return 0
        n, page = self.expect.token_count, self.expect.cache_page_size
        if cached >= n:
            raise self._fail("CACHED_TOKENS_INVALID", f"commit says {cached} of the {n} prompt "
                             "tokens came from prefill's cache; at most all but the last can")
        if page and cached % page:
            raise self._fail("CACHED_TOKENS_INVALID", f"commit says {cached} prompt tokens came "
                             f"from prefill's cache, not a whole number of {page}-token pages")
        return cached

    def finish(self) -> int:
        """Called when the stream ended cleanly; returns the first token or refuses."""
        if self.state == HandoffState.AWAIT_HEADER:
            raise self._fail("HEADER_MISSING", "the handoff stream ended without a header")
        if self.state != HandoffState.COMMITTED:
            raise self._fail("COMMIT_MISSING", f"the handoff stream ended without a commit after "
                             f"{self.chunks_seen} chunks")
        assert self.first_token_id is not None
        return self.first_token_id

