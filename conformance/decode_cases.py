"""Every decode case of the suite: a scripted prefill behaviour and the outcome SPEC.md demands.

Scripts start from a real handoff of the reference prefill (`i.ref`), re-cut into three chunks
per layer (`i.chunks()`), and change exactly one thing (`conformance.decode_edits`).
"""

from __future__ import annotations

import grpc

from common.pb.kvhandoff.v1 import handoff_pb2
from conformance.decode_binding_cases import binding_cases
from conformance.decode_cache_cases import cache_count_cases
from conformance.decode_edits import (
    chunk_with_reference,
    drop_chunk,
    duplicate_chunk,
    edit_chunk,
    flip_last_byte,
    good_with_commit,
    handoff_of_length,
    last_chunk_shifted,
    middle_crc,
    middle_kv,
    one_token_edges,
    other_dtype,
    over_max,
    over_transport,
    overlapping_chunk,
    oversize_tokens,
    placeholder_handoff,
    rejected_header,
    reordered_chunks,
    with_layout,
    with_unknown_fields,
    with_version,
)
from conformance.decode_script import (
    Abort,
    DecodeCase,
    Expect,
    ScriptInput,
    Sleep,
    peer_rejected,
    refused,
    tokens,
)
from conformance.handoff_edit import Frame
from conformance.spec import PROTOCOL_MAJOR

C = grpc.StatusCode
ABORTED = handoff_pb2.HANDOFF_STATUS_ABORTED
UNSPECIFIED = handoff_pb2.HANDOFF_STATUS_UNSPECIFIED
STALL_SECONDS = 3600.0


def _good_case(case_id, rule, summary, script, **kw) -> DecodeCase:
    return DecodeCase(case_id, rule, "MUST", summary, script, tokens(), **kw)


def _case(case_id, rule, summary, script, expect, **kw) -> DecodeCase:
    return DecodeCase(case_id, rule, "MUST", summary, script, expect, **kw)


def decode_cases(stall_deadline: float = 3.0) -> list[DecodeCase]:
    g = ScriptInput.good
    return [
        _good_case("good_passthrough", "D-25", "the reference's frames, unchanged",
                   lambda i: list(i.ref.original)),
        _good_case("good_rechunked_reordered", "D-16", "3 chunks per layer, sent last first",
                   reordered_chunks),
        _good_case("good_minor_version", "D-06", "header protocol 1.999",
                   with_version(PROTOCOL_MAJOR, 999)),
        _good_case("good_unknown_fields", "D-06", "unknown fields in every frame",
                   lambda i: [with_unknown_fields(f) for f in g(i)]),
        _case("status_rejected", "D-08", "REJECTED header (PROMPT_TOO_LONG), INVALID_ARGUMENT",
              lambda i: rejected_header(i, "PROMPT_TOO_LONG", [Abort(
                  C.INVALID_ARGUMENT, "PROMPT_TOO_LONG", "scripted")]),
              peer_rejected("PROMPT_TOO_LONG")),
        _case("status_rejected_pool", "D-08", "REJECTED header (POOL_TOO_SMALL)",
              lambda i: rejected_header(i, "POOL_TOO_SMALL", [Abort(
                  C.RESOURCE_EXHAUSTED, "POOL_TOO_SMALL", "scripted")]),
              peer_rejected("POOL_TOO_SMALL")),
        _case("status_rejected_unknown_code", "D-08", "REJECTED header, unknown reason code",
              lambda i: rejected_header(i, "SOME_FUTURE_CODE", []),
              peer_rejected("SOME_FUTURE_CODE")),
        _case("status_aborted", "D-08", "ABORTED header, then ABORTED error",
              lambda i: [i.ref.header_with(status=ABORTED, reason="scripted"),
                         Abort(C.ABORTED, None, "scripted")], refused("PEER_ABORTED")),
        _case("status_unspecified", "D-08", "header status UNSPECIFIED, otherwise good",
              lambda i: [i.ref.header_with(status=UNSPECIFIED), *g(i)[1:]],
              refused("STATUS_UNSPECIFIED")),
        _case("status_unknown_value", "D-08", "header status 7 (not in the enum)",
              lambda i: [i.ref.header_with(status=7), *g(i)[1:]], refused("STATUS_UNSPECIFIED")),
        _case("chunks_after_rejected", "D-08", "REJECTED header, then every chunk and a commit",
              lambda i: rejected_header(i, "PROMPT_TOO_LONG", g(i)[1:]),
              peer_rejected("PROMPT_TOO_LONG")),
        _case("chunks_after_aborted", "D-08", "ABORTED header, then every chunk and a commit",
              lambda i: [i.ref.header_with(status=ABORTED, reason="scripted"), *g(i)[1:]],
              refused("PEER_ABORTED")),
        _case("commit_aborted", "D-08", "good chunks, commit status ABORTED",
              lambda i: good_with_commit(i, status=ABORTED, reason="scripted"),
              refused("PEER_ABORTED")),
        _case("commit_unspecified", "D-08", "good chunks, commit status UNSPECIFIED",
              lambda i: good_with_commit(i, status=UNSPECIFIED),
              refused("STATUS_UNSPECIFIED")),
        _case("token_count_zero", "D-07", "header token_count 0",
              lambda i: [i.ref.header_with(token_count=0), *g(i)[1:]],
              refused("TOKEN_COUNT_MISMATCH")),
        _case("token_count_placeholder", "D-07", "a 1-token placeholder handoff, consistent in "
              "itself", placeholder_handoff, refused("TOKEN_COUNT_MISMATCH")),
        _case("token_count_short", "D-07", "a consistent handoff of n-1 tokens",
              lambda i: handoff_of_length(i, i.ref.token_count - 1),
              refused("TOKEN_COUNT_MISMATCH")),
        _case("token_count_long", "D-07", "a consistent handoff of n+1 tokens",
              lambda i: handoff_of_length(i, i.ref.token_count + 1),
              refused("TOKEN_COUNT_MISMATCH")),
        _case("reference_on_inline", "D-63", "an inline chunk also carries a shared-memory "
              "reference", chunk_with_reference, refused("REFERENCE_UNEXPECTED")),
        _case("request_id_header", "D-05", "header names another request",
              lambda i: [i.ref.header_with(request_id="conf-someone-else"), *g(i)[1:]],
              refused("REQUEST_ID_MISMATCH")),
        _case("request_id_chunk", "D-05", "one middle chunk names another request",
              lambda i: edit_chunk(i, request_id="conf-someone-else"),
              refused("REQUEST_ID_MISMATCH")),
        _case("request_id_commit", "D-05", "commit names another request",
              lambda i: good_with_commit(i, request_id="conf-someone-else"),
              refused("REQUEST_ID_MISMATCH")),
        _case("chunk_missing", "D-19", "one chunk left out (numbers and commit consistent)",
              lambda i: drop_chunk(i, renumbered=True), refused("COVERAGE_INCOMPLETE")),
        _case("chunk_sequence_gap", "D-11", "one chunk left out, its number skipped",
              lambda i: drop_chunk(i, renumbered=False), refused("CHUNK_SEQUENCE_GAP")),
        _case("chunk_duplicated", "D-16", "one chunk sent twice (renumbered)",
              lambda i: duplicate_chunk(i, renumbered=True), refused("CHUNK_OVERLAP")),
        _case("chunk_resent", "D-11", "one chunk sent twice with its own number",
              lambda i: duplicate_chunk(i, renumbered=False), refused("CHUNK_SEQUENCE_GAP")),
        _case("chunk_overlapping", "D-16", "an extra chunk straddling two chunks of layer 0",
              overlapping_chunk, refused("CHUNK_OVERLAP")),
        _case("chunk_out_of_range", "D-13", "a chunk ending past the token count",
              lambda i: edit_chunk(i, start=i.ref.token_count - 2, end=i.ref.token_count + 2),
              refused("CHUNK_RANGE_INVALID")),
        _case("chunk_range_empty", "D-13", "a chunk of zero tokens", lambda i: edit_chunk(
            i, start=3, end=3), refused("CHUNK_RANGE_INVALID")),
        _case("chunk_range_reversed", "D-13", "token_start > token_end", lambda i: edit_chunk(
            i, start=4, end=2, k=b"", v=b""), refused("CHUNK_RANGE_INVALID")),
        _case("chunk_range_end_past_count", "D-13", "a layer's last chunk one token later: "
              "[s+1, n+1), coverage count unchanged", last_chunk_shifted,
              refused("CHUNK_RANGE_INVALID")),
        _good_case("good_one_token_edges", "D-13", "every layer cut [0,1), [1,n-1), [n-1,n)",
                   one_token_edges),
        _case("chunk_layer_out_of_range", "D-12", "a chunk for layer num_layers",
              lambda i: edit_chunk(i, layer=i.ref.num_layers, k=middle_kv(i)[0],
                                   v=middle_kv(i)[1]), refused("CHUNK_LAYER_OUT_OF_RANGE")),
        _case("chunk_k_short", "D-15", "K one byte short (crc of the bytes sent)",
              lambda i: edit_chunk(i, k=middle_kv(i)[0][:-1]), refused("CHUNK_SIZE_MISMATCH")),
        _case("chunk_v_long", "D-15", "V four bytes long (crc of the bytes sent)",
              lambda i: edit_chunk(i, v=middle_kv(i)[1] + bytes(4)),
              refused("CHUNK_SIZE_MISMATCH")),
        _case("checksum_payload", "D-17", "one V byte flipped, crc as before",
              lambda i: edit_chunk(i, v=flip_last_byte(middle_kv(i)[1]), crc=middle_crc(i)),
              refused("CHECKSUM_MISMATCH")),
        _case("checksum_field", "D-17", "crc32c field off by one bit",
              lambda i: edit_chunk(i, crc=middle_crc(i) ^ 1), refused("CHECKSUM_MISMATCH")),
        _case("model_mismatch", "D-09", "header names another model fingerprint",
              lambda i: [i.ref.header_with(model_fingerprint="another-model"), *g(i)[1:]],
              refused("MODEL_MISMATCH")),
        _case("model_fingerprint_empty", "D-09", "header with an empty model fingerprint",
              lambda i: [i.ref.header_with(model_fingerprint=""), *g(i)[1:]],
              refused("MODEL_MISMATCH")),
        _case("layout_dtype", "D-10", "header dtype differs",
              lambda i: with_layout(i, dtype=other_dtype), refused("LAYOUT_MISMATCH")),
        _case("layout_kv_heads", "D-10", "header num_kv_heads + 1",
              lambda i: with_layout(i, num_kv_heads=lambda lay: lay.num_kv_heads + 1),
              refused("LAYOUT_MISMATCH")),
        _case("layout_head_dim", "D-10", "header head_dim doubled",
              lambda i: with_layout(i, head_dim=lambda lay: lay.head_dim * 2),
              refused("LAYOUT_MISMATCH")),
        _case("layout_layers", "D-10", "header num_layers + 1",
              lambda i: with_layout(i, num_layers=lambda lay: lay.num_layers + 1),
              refused("LAYOUT_MISMATCH")),
        _case("version_major_next", "D-06", "header protocol 2.0",
              with_version(PROTOCOL_MAJOR + 1), refused("VERSION_UNSUPPORTED")),
        _case("version_major_missing", "D-06", "header without protocol_version (0.0)",
              with_version(0), refused("VERSION_UNSUPPORTED")),
        _case("version_major_zero", "D-06", "header protocol 0.1 (major 0 with a minor of "
              "1.1's: not version 1)", with_version(0, 1), refused("VERSION_UNSUPPORTED")),
        _case("stream_empty", "D-04", "the stream ends with no frame at all",
              lambda i: [], refused("HEADER_MISSING")),
        _case("header_missing", "D-04", "chunks and commit with no header",
              lambda i: g(i)[1:], refused("HEADER_MISSING")),
        _case("header_duplicate", "D-04", "a second header after the first",
              lambda i: [g(i)[0], *g(i)], refused("HEADER_DUPLICATE")),
        _case("frame_empty", "D-04", "an empty frame after the header",
              lambda i: [g(i)[0], Frame(), *g(i)[1:]], refused("FRAME_EMPTY")),
        _case("frame_malformed", "D-04", "bytes that do not parse, after the header",
              lambda i: [g(i)[0], b"\x12\x05\xff", *g(i)[1:]], refused("FRAME_MALFORMED")),
        _case("frame_after_commit", "D-04", "a chunk after the commit",
              lambda i: [*g(i), g(i)[1]], refused("FRAME_AFTER_COMMIT")),
        _case("commit_missing", "D-21", "every chunk, then the stream ends",
              lambda i: g(i)[:-1], refused("COMMIT_MISSING")),
        _case("header_only", "D-21", "a good header, then the stream ends",
              lambda i: g(i)[:1], refused("COMMIT_MISSING")),
        _case("commit_token_count", "D-18", "commit token_count n+1",
              lambda i: good_with_commit(i, token_count=i.ref.token_count + 1),
              refused("COMMIT_MISMATCH")),
        _case("commit_chunk_count", "D-18", "commit chunk_count one short",
              lambda i: good_with_commit(i, chunk_count=len(g(i)) - 3),
              refused("COMMIT_MISMATCH")),
        _case("first_token_out_of_vocab", "D-20", "commit first_token_id = vocab_size",
              lambda i: good_with_commit(i, first_token_id=i.vocab_size),
              refused("FIRST_TOKEN_INVALID")),
        _case("chunk_over_max", "D-14", "one chunk over the negotiated max_chunk_bytes",
              over_max, refused("FRAME_TOO_LARGE"), prompt_tokens=oversize_tokens),
        _case("frame_over_transport", "D-14", "one frame 1 MiB over the negotiated maximum",
              over_transport, refused("FRAME_TOO_LARGE")),
        _case("error_before_header", "D-23", "INVALID_ARGUMENT error before any frame",
              lambda i: [Abort(C.INVALID_ARGUMENT, "PROMPT_TOO_LONG", "scripted")],
              peer_rejected("PROMPT_TOO_LONG")),
        _case("error_mid_stream", "D-23", "INTERNAL error after two chunks",
              lambda i: [*g(i)[:3], Abort(C.INTERNAL, None, "scripted failure")],
              refused("PEER_ABORTED")),
        _case("unavailable_mid_stream", "D-23", "UNAVAILABLE error after two chunks",
              lambda i: [*g(i)[:3], Abort(C.UNAVAILABLE, None, "scripted outage")],
              refused("PEER_UNAVAILABLE")),
        DecodeCase("stall_past_deadline", "D-22", "MUST", f"header and a chunk, then silence; "
                   f"client deadline {stall_deadline:g}s", lambda i: [
                       *g(i)[:2], Sleep(STALL_SECONDS)],
                   Expect(C.DEADLINE_EXCEEDED, "HANDOFF_TIMEOUT", reason_optional=True),
                   deadline=stall_deadline),
        DecodeCase("stall_reason_reported", "D-22", "SHOULD", "as stall_past_deadline; decode's "
                   "refusal beats the client's deadline", lambda i: [
                       *g(i)[:2], Sleep(STALL_SECONDS)],
                   Expect(C.DEADLINE_EXCEEDED, "HANDOFF_TIMEOUT"), deadline=stall_deadline),
        *binding_cases(),
        *cache_count_cases(),
        _good_case("good_after_refusals", "D-25", "the reference's frames, unchanged, after "
                   "every refusal", lambda i: list(i.ref.original)),
    ]
