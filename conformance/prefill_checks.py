"""What a well-formed handoff and a well-formed rejection look like (SPEC.md P-01..P-09), checked
frame by frame. Each check returns the problems it found, each prefixed with its rule id."""

from __future__ import annotations

import grpc

from common.handoff.layout import k_bytes_per_token_per_layer
from common.pb.kvhandoff.v1 import handoff_pb2
from conformance.binding import chunk_crc, commit_crc, digest_of
from conformance.spec import (
    DEFAULT_MAX_CHUNK_BYTES,
    ERROR_DOMAIN,
    PROTOCOL_MAJOR,
    REJECTION_STATUS,
)
from conformance.wire import Received, crc32c

OK = handoff_pb2.HANDOFF_STATUS_OK
REJECTED = handoff_pb2.HANDOFF_STATUS_REJECTED
MAX_PROBLEMS = 6


def _status_name(status: int) -> str:
    values = handoff_pb2.HandoffStatus.values()
    return handoff_pb2.HandoffStatus.Name(status) if status in values else str(status)


def check_handoff(request: handoff_pb2.PrefillRequest, info: handoff_pb2.GetPrefillInfoResponse,
                  received: Received) -> list[str]:
    """Problems with a handoff that should have succeeded (empty list: well formed)."""
    problems: list[str] = []
    rid, n = request.request_id, len(request.token_ids)
    kinds = received.kinds()
    if "malformed" in kinds or "empty" in kinds:
        problems.append(f"[P-01] frames that are malformed or empty: {kinds}")
    if received.outcome.code != grpc.StatusCode.OK:
        problems.append(f"[P-07] stream ended with {received.outcome.describe()}")
    if not kinds or kinds[0] != "header":
        return problems + [f"[P-01] first frame is {kinds[:1] or 'missing'}, not a header"]
    if kinds.count("header") != 1 or kinds.count("commit") != 1 or kinds[-1] != "commit":
        problems.append(f"[P-01] frames must be header, chunks, commit; got {_summary(kinds)}")
    header = received.frames[0].header
    problems += _check_header(header, rid, n, info)
    problems += _check_chunks(received.chunks, rid, n, info.layout, request.max_chunk_bytes)
    if request.protocol_version.minor >= 1:
        problems += _check_binding(request, received)
    commits = [f.commit for f in received.frames if f is not None and f.HasField("commit")]
    if commits:
        c = commits[-1]
        if c.request_id != rid:
            problems.append(f"[P-02] commit names request {c.request_id!r}, not {rid!r}")
        if c.status != OK:
            problems.append(f"[P-07] commit status {_status_name(c.status)}: {c.reason}")
        if c.token_count != n:
            problems.append(f"[P-07] commit token_count {c.token_count}, prompt has {n}")
        if c.chunk_count != len(received.chunks):
            problems.append(f"[P-07] commit chunk_count {c.chunk_count}, "
                            f"{len(received.chunks)} chunks sent")
        if c.first_token_id >= info.vocab_size:
            problems.append(f"[P-07] first token {c.first_token_id} outside the vocabulary "
                            f"of {info.vocab_size}")
    return problems[: MAX_PROBLEMS * 3]


def _check_binding(request: handoff_pb2.PrefillRequest, received: Received) -> list[str]:
    """1.1 (P-41..P-43): every frame echoes the nonce; the header's digest is the prompt's;
    every chunk's and the commit's checksum match what they carry."""
    problems: list[str] = []
    frames = [f for f in received.frames if f is not None and f.WhichOneof("frame")]
    for index, f in enumerate(frames):
        kind = f.WhichOneof("frame")
        inner = getattr(f, kind)
        if inner.nonce != request.nonce:
            problems.append(f"[P-41] frame {index} ({kind}) does not echo the request's nonce")
        elif kind == "chunk" and inner.chunk_crc32c != chunk_crc(inner):
            problems.append(f"[P-43] frame {index}: chunk_crc32c {inner.chunk_crc32c:#010x} does "
                            f"not match its metadata and payload")
        elif kind == "commit" and inner.commit_crc32c != commit_crc(inner):
            problems.append(f"[P-43] commit_crc32c {inner.commit_crc32c:#010x} does not match "
                            f"the commit's fields")
        if len(problems) >= MAX_PROBLEMS:
            return problems
    if frames and frames[0].HasField("header"):
        if frames[0].header.protocol_version.minor < 1:
            problems.append(f"[P-41] a 1.{request.protocol_version.minor} request answered with "
                            f"protocol 1.{frames[0].header.protocol_version.minor}")
        if frames[0].header.prompt_digest != digest_of(list(request.token_ids)):
            problems.append("[P-42] header prompt_digest is not SHA-256 of the prompt's ids")
    return problems


def _check_header(header, rid: str, n: int, info) -> list[str]:
    problems = []
    if header.request_id != rid:
        problems.append(f"[P-02] header names request {header.request_id!r}, not {rid!r}")
    if header.protocol_version.major != PROTOCOL_MAJOR:
        problems.append(f"[P-03] header protocol major {header.protocol_version.major}")
    if header.status != OK:
        problems.append(f"[P-03] header status {_status_name(header.status)} "
                        f"({header.reason_code}: {header.reason})")
    if header.token_count != n:
        problems.append(f"[P-03] header token_count {header.token_count}, prompt has {n}")
    if header.layout != info.layout:
        problems.append(f"[P-03] header layout {header.layout} differs from GetPrefillInfo's")
    if header.model_fingerprint != info.model_fingerprint:
        problems.append(f"[P-03] header model {header.model_fingerprint!r} is not "
                        f"GetPrefillInfo's {info.model_fingerprint!r}")
    return problems


def _check_chunks(chunks, rid: str, n: int, layout, max_chunk_bytes: int) -> list[str]:
    problems: list[str] = []
    limit = max_chunk_bytes or DEFAULT_MAX_CHUNK_BYTES
    per_token = k_bytes_per_token_per_layer(layout)
    covered = [bytearray(n) for _ in range(layout.num_layers)]
    for index, c in enumerate(chunks):
        where = f"chunk {index}"
        found = []
        if c.request_id != rid:
            found.append(f"[P-02] {where} names request {c.request_id!r}, not {rid!r}")
        if c.sequence_number != index:
            found.append(f"[P-04] {where} has sequence number {c.sequence_number}")
        if c.layer >= layout.num_layers:
            found.append(f"[P-04] {where} layer {c.layer} >= {layout.num_layers}")
        if not c.token_start < c.token_end <= n:
            found.append(f"[P-04] {where} range [{c.token_start}, {c.token_end}) not in [0, {n})")
        size = (c.token_end - c.token_start) * per_token
        if len(c.k) != size or len(c.v) != size:
            found.append(f"[P-04] {where} K/V {len(c.k)}/{len(c.v)} bytes, layout needs {size}")
        if len(c.k) + len(c.v) > limit:
            found.append(f"[P-06] {where} payload {len(c.k) + len(c.v)} > max_chunk_bytes {limit}")
        if crc32c(c.k, c.v) != c.crc32c:
            found.append(f"[P-04] {where} crc32c {c.crc32c:#010x} is wrong")
        if not found:
            row = covered[c.layer]
            if row.find(1, c.token_start, c.token_end) != -1:
                found.append(f"[P-05] {where} layer {c.layer} [{c.token_start}, {c.token_end}) "
                             f"overlaps an earlier chunk")
            row[c.token_start:c.token_end] = b"\x01" * (c.token_end - c.token_start)
        problems += found
        if len(problems) >= MAX_PROBLEMS:
            return problems
    for layer, row in enumerate(covered):
        missing = row.count(0)
        if missing:
            problems.append(f"[P-05] layer {layer}: {missing} of {n} tokens not covered")
    return problems


def check_rejection(request: handoff_pb2.PrefillRequest, received: Received,
                    reason_code: str) -> list[str]:
    """Problems with a rejection: exactly one REJECTED header naming the request, its token
    count and the reason code, echoing its nonce (P-41: whatever the request's minor, as a 1.1
    prefill does), no chunk, no commit, then the gRPC error of the code's status."""
    problems: list[str] = []
    kinds = received.kinds()
    code = REJECTION_STATUS[reason_code]
    if kinds != ["header"]:
        problems.append(f"[P-09] frames {_summary(kinds)}; a rejection is one header and nothing "
                        f"after it")
    if kinds and kinds[0] == "header":
        h = received.frames[0].header
        if h.status != REJECTED:
            problems.append(f"[P-08] header status {_status_name(h.status)}, expected REJECTED "
                            f"(token_count {h.token_count}, prompt {len(request.token_ids)})")
        if h.reason_code != reason_code:
            problems.append(f"[P-09] header reason_code {h.reason_code!r}, expected {reason_code}")
        if not h.reason:
            problems.append("[P-09] header reason (for a person) is empty")
        if h.request_id != request.request_id:
            problems.append(f"[P-02] header names request {h.request_id!r}")
        if h.token_count != len(request.token_ids):
            problems.append(f"[P-09] header token_count {h.token_count}, the request has "
                            f"{len(request.token_ids)} tokens")
        if request.nonce and h.nonce != request.nonce:
            problems.append(f"[P-41] the rejection's header carries nonce "
                            f"{bytes(h.nonce).hex() or 'none'}, not the request's "
                            f"{bytes(request.nonce).hex()}")
    out = received.outcome
    if out.code != code or out.reason != reason_code or out.domain != ERROR_DOMAIN:
        problems.append(f"[P-09] stream ended with {out.describe()} (domain {out.domain}); "
                        f"expected {code.name} reason={reason_code} domain={ERROR_DOMAIN}")
    return problems


def _summary(kinds: list[str]) -> str:
    if len(kinds) <= 6:
        return str(kinds)
    return f"{kinds[:3]} ... {kinds[-2:]} ({len(kinds)} frames)"
