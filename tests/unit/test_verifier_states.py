"""The verifier's state machine, in process and fast: every refusal of SPEC.md §7.1 that the
verifier makes, from frames built in memory, each at the frame (or the end of stream) that must
trigger it, with the reason and the gRPC status of the table; a good handoff through every
state; and no way back from REFUSED.

Each case feeds frames that are all acceptable up to its last one (or up to `finish()`), so a
case passes only when the refusal comes exactly where the spec puts it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import google_crc32c
import grpc
import pytest
import torch

from common.handoff.binding import chunk_checksum, chunk_metadata, commit_checksum, prompt_digest
from common.handoff.layout import KvLayout
from common.handoff.reasons import REFUSAL_CODES, HandoffRefused
from common.handoff.verifier import Expectation, HandoffState, HandoffVerifier
from common.pb.kvhandoff.v1 import common_pb2, handoff_pb2
from decode_svc.prefill_client import parse_frame

LAYOUT = KvLayout(num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float32)
PER_TOKEN = LAYOUT.k_bytes_per_token_per_layer  # 8 bytes of K (and of V) per token and layer
RID, FINGERPRINT, TOKENS, VOCAB, FIRST = "r1", "fp-1", 3, 10, 5
PROMPT, NONCE = [4, 1, 7], bytes(range(16))
EXPECT = Expectation(RID, TOKENS, LAYOUT, FINGERPRINT, max_chunk_bytes=1 << 20,
                     vocab_size=VOCAB, nonce=NONCE, prompt_digest=prompt_digest(PROMPT))
OK = handoff_pb2.HANDOFF_STATUS_OK
REJECTED = handoff_pb2.HANDOFF_STATUS_REJECTED
ABORTED = handoff_pb2.HANDOFF_STATUS_ABORTED
# (sequence number, layer, token_start, token_end): every layer-token once, layer-major
GOOD_RANGES = [(0, 0, 0, 2), (1, 0, 2, 3), (2, 1, 0, 2), (3, 1, 2, 3)]
# refusals made outside the verifier, from the status gRPC reports (decode_svc/handoff.py); a
# frame that does not parse is refused by decode's frame parser (last test but one)
FROM_GRPC_STATUS = {"HANDOFF_TIMEOUT", "PEER_UNAVAILABLE"}
# refusals of the KV content after the commit (decode_svc/content_check.py, tests/fail_closed)
FROM_CONTENT_CHECKS = {"KV_NOT_FINITE", "KV_LAYER0_MISMATCH", "KV_DEPTH_MISMATCH"}


def header(**fields) -> handoff_pb2.PrefillResponse:
    values = {"protocol_version": common_pb2.ProtocolVersion(major=1, minor=1),
              "request_id": RID, "token_count": TOKENS, "status": OK, "layout": LAYOUT.to_proto(),
              "model_fingerprint": FINGERPRINT, "nonce": NONCE,
              "prompt_digest": prompt_digest(PROMPT), **fields}
    return handoff_pb2.PrefillResponse(header=handoff_pb2.HandoffHeader(**values))


def payload(seq: int, start: int, end: int, salt: int) -> bytes:
    return bytes((seq * 31 + salt + i) % 256 for i in range((end - start) * PER_TOKEN))


def chunk(seq: int, layer: int, start: int, end: int, **fields) -> handoff_pb2.PrefillResponse:
    k = fields.pop("k", payload(seq, start, end, 0))
    v = fields.pop("v", payload(seq, start, end, 128))
    crc = fields.pop("crc32c", google_crc32c.extend(google_crc32c.value(k), v))
    values = {"request_id": RID, "sequence_number": seq, "layer": layer, "token_start": start,
              "token_end": end, "k": k, "v": v, "crc32c": crc, "nonce": NONCE, **fields}
    if "chunk_crc32c" not in values:  # sealed over what it carries (its true payload crc)
        true_crc = google_crc32c.extend(google_crc32c.value(k), v)
        values["chunk_crc32c"] = chunk_checksum(true_crc, chunk_metadata(
            values["request_id"], values["nonce"], seq, layer, start, end))
    return handoff_pb2.PrefillResponse(chunk=handoff_pb2.KvChunk(**values))


def chunks(ranges=GOOD_RANGES) -> list[handoff_pb2.PrefillResponse]:
    return [chunk(*r) for r in ranges]


def commit(**fields) -> handoff_pb2.PrefillResponse:
    values = {"request_id": RID, "token_count": TOKENS, "chunk_count": len(GOOD_RANGES),
              "first_token_id": FIRST, "status": OK, "nonce": NONCE, **fields}
    values.setdefault("commit_crc32c", commit_checksum(
        values["request_id"], values["nonce"], values["token_count"], values["chunk_count"],
        values["first_token_id"], values["status"], values.get("cached_tokens", 0)))
    return handoff_pb2.PrefillResponse(commit=handoff_pb2.HandoffCommit(**values))


def good() -> list[handoff_pb2.PrefillResponse]:
    return [header(), *chunks(), commit()]


@dataclass(frozen=True)
class Refusal:
    """frames: all acceptable but the last, which is refused; at_finish: all acceptable, and
    finish() (the stream ended) is refused."""

    case_id: str
    reason: str
    frames: list = field(default_factory=list)
    at_finish: bool = False
    expect: Expectation = EXPECT
    code: grpc.StatusCode | None = None  # None: the reason's status in REFUSAL_CODES


CASES = [
    Refusal("header_rejected", "PEER_REJECTED",
            [header(status=REJECTED, reason="too long", reason_code="POOL_TOO_SMALL")],
            code=grpc.StatusCode.RESOURCE_EXHAUSTED),
    Refusal("header_rejected_unknown_code", "PEER_REJECTED",
            [header(status=REJECTED, reason_code="NO_SUCH_CODE")],
            code=grpc.StatusCode.FAILED_PRECONDITION),
    Refusal("header_aborted", "PEER_ABORTED", [header(status=ABORTED, reason="oom")]),
    Refusal("commit_aborted", "PEER_ABORTED", [header(), *chunks()[:2], commit(status=ABORTED)]),
    Refusal("header_status_unspecified", "STATUS_UNSPECIFIED", [header(status=0)]),
    Refusal("header_status_unknown", "STATUS_UNSPECIFIED", [header(status=99)]),
    Refusal("commit_status_unspecified", "STATUS_UNSPECIFIED",
            [header(), *chunks(), commit(status=0)]),
    Refusal("chunk_before_header", "HEADER_MISSING", [chunks()[0]]),
    Refusal("commit_before_header", "HEADER_MISSING", [commit()]),
    Refusal("stream_without_frames", "HEADER_MISSING", [], at_finish=True),
    Refusal("second_header", "HEADER_DUPLICATE", [header(), chunks()[0], header()]),
    Refusal("empty_frame", "FRAME_EMPTY", [header(), handoff_pb2.PrefillResponse()]),
    Refusal("chunk_after_commit", "FRAME_AFTER_COMMIT", [*good(), chunks()[0]]),
    Refusal("header_after_commit", "FRAME_AFTER_COMMIT", [*good(), header()]),
    Refusal("header_of_another_request", "REQUEST_ID_MISMATCH", [header(request_id="r2")]),
    Refusal("chunk_of_another_request", "REQUEST_ID_MISMATCH",
            [header(), chunk(0, 0, 0, 2, request_id="r2")]),
    Refusal("commit_of_another_request", "REQUEST_ID_MISMATCH",
            [header(), *chunks(), commit(request_id="r2")]),
    Refusal("major_version_2", "VERSION_UNSUPPORTED",
            [header(protocol_version=common_pb2.ProtocolVersion(major=2))]),
    Refusal("major_version_0", "VERSION_UNSUPPORTED",
            [header(protocol_version=common_pb2.ProtocolVersion(major=0))]),
    Refusal("header_token_count", "TOKEN_COUNT_MISMATCH", [header(token_count=TOKENS + 1)]),
    Refusal("other_model", "MODEL_MISMATCH", [header(model_fingerprint="fp-2")]),
    Refusal("other_dtype", "LAYOUT_MISMATCH", [header(layout=dataclasses.replace(
        LAYOUT, dtype=torch.bfloat16).to_proto())]),
    Refusal("other_layer_count", "LAYOUT_MISMATCH", [header(layout=dataclasses.replace(
        LAYOUT, num_layers=3).to_proto())]),
    Refusal("first_chunk_numbered_1", "CHUNK_SEQUENCE_GAP", [header(), chunk(1, 0, 0, 2)]),
    Refusal("chunk_number_repeated", "CHUNK_SEQUENCE_GAP",
            [header(), chunk(0, 0, 0, 2), chunk(0, 0, 2, 3)]),
    Refusal("layer_past_the_model", "CHUNK_LAYER_OUT_OF_RANGE", [header(), chunk(0, 2, 0, 2)]),
    Refusal("empty_token_range", "CHUNK_RANGE_INVALID", [header(), chunk(0, 0, 1, 1)]),
    Refusal("range_past_the_prompt", "CHUNK_RANGE_INVALID", [header(), chunk(0, 0, 2, 4)]),
    Refusal("range_reversed", "CHUNK_RANGE_INVALID",
            [header(), chunk(0, 0, 2, 1, k=b"", v=b"")]),
    Refusal("payload_over_the_limit", "FRAME_TOO_LARGE", [header(), chunk(0, 0, 0, 2)],
            expect=dataclasses.replace(EXPECT, max_chunk_bytes=4 * PER_TOKEN - 1)),
    Refusal("k_one_byte_short", "CHUNK_SIZE_MISMATCH",
            [header(), chunk(0, 0, 0, 2, k=payload(0, 0, 2, 0)[:-1])]),
    Refusal("v_one_byte_long", "CHUNK_SIZE_MISMATCH",
            [header(), chunk(0, 0, 0, 2, v=payload(0, 0, 2, 128) + b"\0")]),
    Refusal("tokens_sent_twice", "CHUNK_OVERLAP",
            [header(), chunk(0, 0, 0, 2), chunk(1, 0, 1, 3)]),
    Refusal("crc_off_by_one", "CHECKSUM_MISMATCH", [header(), chunk(
        0, 0, 0, 2, crc32c=google_crc32c.extend(google_crc32c.value(payload(0, 0, 2, 0)),
                                                payload(0, 0, 2, 128)) ^ 1)]),
    Refusal("commit_token_count", "COMMIT_MISMATCH",
            [header(), *chunks(), commit(token_count=TOKENS - 1)]),
    Refusal("commit_chunk_count", "COMMIT_MISMATCH",
            [header(), *chunks(), commit(chunk_count=len(GOOD_RANGES) + 1)]),
    Refusal("a_layer_token_never_sent", "COVERAGE_INCOMPLETE",
            [header(), *chunks(GOOD_RANGES[:3]), commit(chunk_count=3)]),
    Refusal("first_token_outside_the_vocabulary", "FIRST_TOKEN_INVALID",
            [header(), *chunks(), commit(first_token_id=VOCAB)]),
    Refusal("stream_ends_after_the_chunks", "COMMIT_MISSING", [header(), *chunks()],
            at_finish=True),
    Refusal("stream_ends_after_the_header", "COMMIT_MISSING", [header()], at_finish=True),
    Refusal("header_of_another_handoff", "NONCE_MISMATCH", [header(nonce=bytes(16))]),
    Refusal("chunk_of_another_handoff", "NONCE_MISMATCH",
            [header(), chunk(0, 0, 0, 2, nonce=bytes(16))]),
    Refusal("commit_of_another_handoff", "NONCE_MISMATCH",
            [header(), *chunks(), commit(nonce=b"")]),
    Refusal("digest_of_other_tokens", "PROMPT_DIGEST_MISMATCH",
            [header(prompt_digest=prompt_digest([4, 1, 8]))]),
    Refusal("chunk_relabelled", "FRAME_CHECKSUM_MISMATCH",
            [header(), chunk(0, 0, 0, 2, chunk_crc32c=chunk(0, 1, 0, 2).chunk.chunk_crc32c)]),
    Refusal("commit_changed_after_sealing", "FRAME_CHECKSUM_MISMATCH",
            [header(), *chunks(), commit(first_token_id=FIRST + 1,
                                         commit_crc32c=commit().commit.commit_crc32c)]),
    Refusal("protocol_1_0", "VERSION_UNSUPPORTED",
            [header(protocol_version=common_pb2.ProtocolVersion(major=1, minor=0))]),
    Refusal("cached_tokens_whole_prompt", "CACHED_TOKENS_INVALID",
            [header(protocol_version=common_pb2.ProtocolVersion(major=1, minor=2)), *chunks(),
             commit(cached_tokens=TOKENS)]),
    Refusal("cached_tokens_part_page", "CACHED_TOKENS_INVALID",
            [header(protocol_version=common_pb2.ProtocolVersion(major=1, minor=2)), *chunks(),
             commit(cached_tokens=1)], expect=dataclasses.replace(EXPECT, cache_page_size=2)),
]


def test_a_good_handoff_goes_through_every_state():
    verifier = HandoffVerifier(EXPECT)
    assert verifier.state == HandoffState.AWAIT_HEADER
    assert verifier.on_frame(header()) is None
    assert verifier.state == HandoffState.RECEIVING
    written = [verifier.on_frame(frame) for frame in chunks()]
    assert [(c.layer, c.token_start, c.token_end) for c in written] == [
        r[1:] for r in GOOD_RANGES]
    assert written[0].k == payload(0, 0, 2, 0) and written[0].v == payload(0, 0, 2, 128)
    assert verifier.state == HandoffState.RECEIVING
    assert verifier.on_frame(commit()) is None
    assert verifier.state == HandoffState.COMMITTED
    assert verifier.finish() == FIRST


@pytest.mark.parametrize("case", CASES, ids=[c.case_id for c in CASES])
def test_each_refusal_comes_at_its_frame(case: Refusal):
    verifier = HandoffVerifier(case.expect)
    *accepted, last = case.frames if not case.at_finish else [*case.frames, None]
    for frame in accepted:
        verifier.on_frame(frame)  # raises here if the case refuses too early
        assert verifier.state != HandoffState.REFUSED
    with pytest.raises(HandoffRefused) as refused:
        verifier.finish() if case.at_finish else verifier.on_frame(last)
    assert refused.value.reason == case.reason, refused.value.message
    assert refused.value.code == (case.code or REFUSAL_CODES[case.reason])
    assert refused.value.message
    assert verifier.state == HandoffState.REFUSED


@pytest.mark.parametrize("case", [c for c in CASES if not c.at_finish][:8],
                         ids=lambda c: c.case_id)
def test_there_is_no_way_back_from_refused(case: Refusal):
    verifier = HandoffVerifier(case.expect)
    with pytest.raises(HandoffRefused):
        for frame in case.frames:
            verifier.on_frame(frame)
    for frame in good():  # not even a perfect handoff afterwards
        with pytest.raises(HandoffRefused):
            verifier.on_frame(frame)
    with pytest.raises(HandoffRefused):
        verifier.finish()
    assert verifier.state == HandoffState.REFUSED


def test_a_frame_that_does_not_parse_is_refused_before_the_verifier():
    with pytest.raises(HandoffRefused) as refused:
        parse_frame(b"\x12\x05\x0a")  # a chunk field that claims 5 bytes and has 1
    assert refused.value.reason == "FRAME_MALFORMED"
    assert refused.value.code == REFUSAL_CODES["FRAME_MALFORMED"]


def test_every_refusal_of_the_spec_has_a_case_here():
    covered = {c.reason for c in CASES} | {"FRAME_MALFORMED"}
    assert covered | FROM_GRPC_STATUS | FROM_CONTENT_CHECKS == set(REFUSAL_CODES)
    assert not covered & (FROM_GRPC_STATUS | FROM_CONTENT_CHECKS)
