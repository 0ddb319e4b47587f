"""`kvhandoff conformance prefill`: the suite acts as a decode against a prefill under test.

It asks GetPrefillInfo for the model, layout and limits, then runs each case (SPEC.md P-xx)
and checks the prefill's pool (StatsService) is back at its idle reading after every case.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import uuid
from dataclasses import dataclass

import grpc

from common.handoff.layout import DTYPE_BYTES, kv_bytes_per_token_per_layer
from common.pb.kvhandoff.v1 import common_pb2, handoff_pb2, handoff_pb2_grpc
from conformance.binding import MIN_NONCE_BYTES
from conformance.pool import PoolWatch
from conformance.prefill_cache_cases import cache_unscoped_untouched, kv_cached_whole_pages
from conformance.prefill_checks import check_handoff, check_rejection
from conformance.prefill_content import (
    ReferencePrefill,
    kv_cached_prefix_consistent,
    kv_layers_distinct,
    kv_matches_reference,
    kv_prefix_consistent,
)
from conformance.prefill_planes import (
    data_planes_offered,
    plane_not_offered,
    plane_shm_no_host_id,
    plane_shm_other_host,
)
from conformance.report import CaseResult, Selection
from conformance.runner import Case, NotApplicable, prompt_ids, run_cases
from conformance.spec import PROTOCOL_MAJOR, PROTOCOL_MINOR
from conformance.wire import read_handoff, unknown_field

MAX_AT_LIMIT_TOKENS = 4096  # the at-limit case uses min(max_prompt_tokens, this)
CONCURRENT_HANDOFFS = 6


@dataclass
class PrefillTarget:
    channel: grpc.aio.Channel
    info: handoff_pb2.GetPrefillInfoResponse
    pool: PoolWatch
    timeout: float
    reference: ReferencePrefill | None = None
    kv_tolerance: float | None = None  # None: KV_TOLERANCE of the layout's dtype

    def request(self, case_id: str, token_ids: list[int], **fields) -> handoff_pb2.PrefillRequest:
        """A 1.1 request with a fresh nonce unless fields say otherwise; protocol_version=None
        leaves the field unset (it then reads as 0.0)."""
        version = fields.pop("protocol_version", common_pb2.ProtocolVersion(
            major=PROTOCOL_MAJOR, minor=PROTOCOL_MINOR))
        fields.setdefault("nonce", secrets.token_bytes(MIN_NONCE_BYTES))
        return handoff_pb2.PrefillRequest(
            request_id=fields.pop("request_id", f"conf-{case_id}-{uuid.uuid4().hex[:12]}"),
            token_ids=token_ids, protocol_version=version,
            model_fingerprint=fields.pop("model_fingerprint", self.info.model_fingerprint),
            sampling=common_pb2.SamplingParams(temperature=0.0), **fields)

    def prompt(self, length: int, seed: int) -> list[int]:
        return prompt_ids(length, self.info.vocab_size, seed)


def _handoff_case(case_id: str, length, seed: int, expectation: str, rule: str = "P-01..P-07",
                  extra: bytes = b"", **fields) -> Case[PrefillTarget]:
    """A prompt that must be served; length is an int or a function of the target."""
    async def run(t: PrefillTarget) -> list[str]:
        n = length(t) if callable(length) else length
        chunk_limit = fields.get("max_chunk_bytes")
        request = t.request(case_id, t.prompt(n, seed), **{
            **fields, **({"max_chunk_bytes": chunk_limit(t)} if callable(chunk_limit) else {})})
        return check_handoff(request, t.info, await read_handoff(t.channel, request, t.timeout,
                                                                 extra))
    return Case(case_id, rule, "MUST", expectation, run)


def _rejection_case(case_id: str, rule: str, reason_code: str, expectation: str, prompt,
                    level: str = "MUST", **fields) -> Case[PrefillTarget]:
    async def run(t: PrefillTarget) -> list[str]:
        request = t.request(case_id, prompt(t), **fields)
        received = await read_handoff(t.channel, request, t.timeout)
        return check_rejection(request, received, reason_code)
    return Case(case_id, rule, level, expectation, run)


async def _check_info(t: PrefillTarget) -> list[str]:
    i, problems = t.info, []
    if i.layout.num_layers < 1 or i.layout.num_kv_heads < 1 or i.layout.head_dim < 1:
        problems.append(f"[P-16] layout {i.layout} has an empty dimension")
    if i.layout.dtype not in DTYPE_BYTES:
        problems.append(f"[P-16] layout dtype {i.layout.dtype} is not a KvDtype value")
    if not any(v.major == PROTOCOL_MAJOR for v in i.protocol_versions):
        problems.append(f"[G-02] protocol_versions {list(i.protocol_versions)} lacks major 1")
    elif not any(v.major == PROTOCOL_MAJOR and v.minor >= PROTOCOL_MINOR
                 for v in i.protocol_versions):
        problems.append(f"[P-44] protocol_versions {list(i.protocol_versions)} lacks 1.1")
    if not 0 < i.max_prompt_tokens <= i.max_context_tokens:
        problems.append(f"[P-16] max_prompt_tokens {i.max_prompt_tokens} not in "
                        f"(0, max_context_tokens {i.max_context_tokens}]")
    if i.vocab_size < 1 or not i.model_fingerprint or i.page_size < 1:
        problems.append("[P-16] vocab_size, model_fingerprint and page_size must be set")
    stats = await t.pool.read()
    if stats.role != "prefill" or stats.pool.pages_total < 1:
        problems.append(f"[G-07] StatsService says role {stats.role!r}, "
                        f"{stats.pool.pages_total} pages")
    return problems


def _beyond_pool(t: PrefillTarget) -> list[int]:
    if t.info.max_prompt_tokens >= t.info.max_context_tokens:
        raise NotApplicable(f"max_prompt_tokens {t.info.max_prompt_tokens} equals the window "
                            f"{t.info.max_context_tokens}: no prompt is inside the window but "
                            f"beyond the pool")
    return t.prompt(int(t.info.max_prompt_tokens) + 1, 5)


async def _cancel_mid_stream(t: PrefillTarget) -> list[str]:
    n = min(int(t.info.max_prompt_tokens), 1024)
    request = t.request("cancel_mid_stream", t.prompt(n, 11),  # one token per chunk
                        max_chunk_bytes=kv_bytes_per_token_per_layer(t.info.layout))
    received = await read_handoff(t.channel, request, t.timeout, stop_after=2)
    kinds = received.kinds()
    if kinds[:1] != ["header"]:
        return [f"[P-01] first frame {kinds[:1]}, expected a header"]
    # the pool check after the case (settle) is what shows the cancellation was honoured
    return []


async def _concurrent(t: PrefillTarget) -> list[str]:
    lengths = [1 + 7 * i for i in range(CONCURRENT_HANDOFFS)]
    limit = int(t.info.max_prompt_tokens)
    requests = [t.request(f"concurrent{i}", t.prompt(min(n, limit), 100 + i),
                          max_chunk_bytes=kv_bytes_per_token_per_layer(t.info.layout) * 4)
                for i, n in enumerate(lengths)]
    streams = await asyncio.gather(*(read_handoff(t.channel, r, t.timeout) for r in requests))
    problems = []
    for request, received in zip(requests, streams):
        problems += [f"{request.request_id}: {p}" for p in check_handoff(request, t.info, received)]
    return problems


async def _final_pool_idle(t: PrefillTarget) -> list[str]:
    pool, base = (await t.pool.read()).pool, t.pool.baseline
    if (pool.pages_free, pool.pages_total) != (base.pages_free, base.pages_total):
        return [f"[G-07] {pool.pages_free}/{pool.pages_total} pages free after the suite; "
                f"{base.pages_free}/{base.pages_total} before it"]
    return []


def _over_window(t: PrefillTarget) -> list[int]:
    return t.prompt(int(t.info.max_context_tokens) + 1, 4)


def prefill_cases() -> list[Case[PrefillTarget]]:
    three_token_chunks = lambda t: kv_bytes_per_token_per_layer(t.info.layout) * 3  # noqa: E731
    return [
        Case("handshake_info", "P-16", "MUST", "GetPrefillInfo and GetStats describe a sane, "
             "idle prefill", _check_info),
        _handoff_case("handoff_one_token", 1, 1, "1-token prompt: header, chunks, commit, "
                      "well formed"),
        _handoff_case("handoff_pages_plus", lambda t: min(2 * t.info.page_size + 3,
                                                          t.info.max_prompt_tokens), 2,
                      "prompt of 2 pages + 3 tokens: well formed"),
        _handoff_case("handoff_small_chunks", lambda t: min(20, t.info.max_prompt_tokens), 3,
                      "max_chunk_bytes of 3 tokens: every chunk within it, full coverage",
                      max_chunk_bytes=three_token_chunks),
        _handoff_case("handoff_at_limit", lambda t: min(t.info.max_prompt_tokens,
                                                        MAX_AT_LIMIT_TOKENS), 6,
                      "prompt of max_prompt_tokens (capped at 4096) is served", rule="P-10"),
        _handoff_case("minor_version_accepted", 5, 7, "protocol 1.999 is served (unknown minor)",
                      rule="G-03", protocol_version=common_pb2.ProtocolVersion(
                          major=PROTOCOL_MAJOR, minor=999)),
        _handoff_case("unknown_field_ignored", 5, 8, "a request with an unknown field is served",
                      rule="G-04", extra=unknown_field()),
        _handoff_case("handoff_1_0_request", 5, 15, "a 1.0 request (no nonce) is served",
                      rule="G-03", nonce=b"", protocol_version=common_pb2.ProtocolVersion(
                          major=PROTOCOL_MAJOR, minor=0)),
        _handoff_case("binding_long_prompt", lambda t: min(3 * t.info.page_size + 5,
                                                           t.info.max_prompt_tokens), 16,
                      "1.1: every frame echoes the nonce, the digest and checksums match",
                      rule="P-41..P-43", max_chunk_bytes=three_token_chunks),
        _rejection_case("reject_short_nonce", "P-40", "NONCE_INVALID", "a 1.1 request with a "
                        "15-byte nonce: REJECTED, INVALID_ARGUMENT", lambda t: t.prompt(3, 17),
                        nonce=bytes(MIN_NONCE_BYTES - 1)),
        _rejection_case("reject_empty_prompt", "P-08", "EMPTY_PROMPT", "empty prompt: REJECTED "
                        "header only, then INVALID_ARGUMENT", lambda t: []),
        _rejection_case("reject_out_of_vocab", "P-08", "TOKEN_OUT_OF_VOCAB", "id == vocab_size: "
                        "REJECTED header only, then INVALID_ARGUMENT",
                        lambda t: t.prompt(4, 9) + [t.info.vocab_size]),
        _rejection_case("reject_over_window", "P-08", "PROMPT_TOO_LONG", "max_context_tokens+1: "
                        "REJECTED header only (no placeholder), then INVALID_ARGUMENT",
                        _over_window),
        _rejection_case("reject_beyond_pool", "P-08", "POOL_TOO_SMALL", "max_prompt_tokens+1 "
                        "inside the window: REJECTED header only, then RESOURCE_EXHAUSTED",
                        _beyond_pool),
        _rejection_case("reject_major_version", "G-02", "VERSION_UNSUPPORTED", "protocol 2.0: "
                        "REJECTED header only, then FAILED_PRECONDITION", lambda t: t.prompt(3, 10),
                        protocol_version=common_pb2.ProtocolVersion(major=PROTOCOL_MAJOR + 1)),
        _rejection_case("reject_missing_version", "G-02", "VERSION_UNSUPPORTED", "no "
                        "protocol_version (reads as 0.0): REJECTED header only, then "
                        "FAILED_PRECONDITION", lambda t: t.prompt(3, 15), protocol_version=None),
        _rejection_case("reject_missing_request_id", "P-08", "MISSING_REQUEST_ID", "empty "
                        "request_id: REJECTED header only, then INVALID_ARGUMENT",
                        lambda t: t.prompt(3, 12), request_id=""),
        _rejection_case("reject_chunk_limit_too_small", "P-08", "CHUNK_LIMIT_TOO_SMALL",
                        "max_chunk_bytes below the K+V of one token in one layer: REJECTED, "
                        "INVALID_ARGUMENT",
                        lambda t: t.prompt(3, 13), max_chunk_bytes=1),
        _rejection_case("reject_model_mismatch", "P-11", "MODEL_MISMATCH", "another model's "
                        "fingerprint: REJECTED, FAILED_PRECONDITION", lambda t: t.prompt(3, 14),
                        level="SHOULD", model_fingerprint="not-the-served-model"),
        Case("data_planes_offered", "P-60", "MUST", "GetPrefillInfo's data_planes list "
             "INLINE, no plane twice, and a SHARED_MEMORY offer carries its host_id",
             data_planes_offered),
        Case("plane_not_offered", "P-61", "MUST", "a request naming a plane the prefill does "
             "not offer: REJECTED DATA_PLANE_UNAVAILABLE, FAILED_PRECONDITION",
             plane_not_offered),
        Case("plane_shm_no_host_id", "P-61", "MUST", "a SHARED_MEMORY request naming no "
             "data_plane_host_id: REJECTED DATA_PLANE_UNAVAILABLE (skipped unless offered)",
             plane_shm_no_host_id),
        Case("plane_shm_other_host", "P-61", "MUST", "a SHARED_MEMORY request naming another "
             "host id: REJECTED DATA_PLANE_UNAVAILABLE (skipped unless offered)",
             plane_shm_other_host),
        Case("cancel_mid_stream", "P-13", "MUST", "cancel after the first chunk: the pool is "
             "back at its baseline shortly after", _cancel_mid_stream),
        Case("kv_matches_reference", "P-17", "MUST", "KV of 1 token and of 4 pages + 3 equal "
             "the --reference-prefill's within the dtype's tolerance (skipped without one)",
             kv_matches_reference),
        Case("kv_layers_distinct", "P-17", "MUST", "no layer's K or V equals another layer's "
             "(e.g. layer 0's KV sent for every layer)", kv_layers_distinct),
        Case("kv_prefix_consistent", "P-17", "MUST", "the KV of a prompt's first half equal "
             "the KV of that half alone, within the tolerance", kv_prefix_consistent),
        Case("kv_cached_prefix_consistent", "P-81", "MUST", "under one cache scope a prompt, "
             "a sibling sharing its first page, the prompt again: their KV equal the KV "
             "computed under a fresh scope", kv_cached_prefix_consistent),
        Case("kv_cached_whole_pages", "P-81", "MUST", "a prompt of 4 whole pages twice under "
             "one scope, then under a fresh one: each served within 30 s, the repeat's KV "
             "equal the fresh KV", kv_cached_whole_pages),
        Case("cache_unscoped_untouched", "P-80", "MUST", "unscoped requests compute every "
             "token and add no cached page, also after a scoped request of the same prompt "
             "(GetStats counters, P-83; skipped without them)", cache_unscoped_untouched),
        Case("concurrent_handoffs", "P-14", "MUST", f"{CONCURRENT_HANDOFFS} concurrent handoffs "
             "are each well formed, with their own request id", _concurrent),
        Case("final_pool_idle", "G-07", "MUST", "after every case the pool is as before the first",
             _final_pool_idle),
    ]


async def _info(channel: grpc.aio.Channel, timeout: float) -> handoff_pb2.GetPrefillInfoResponse:
    return await handoff_pb2_grpc.HandoffServiceStub(channel).GetPrefillInfo(
        handoff_pb2.GetPrefillInfoRequest(), timeout=timeout, wait_for_ready=True)


async def run_prefill_suite(target: str, selection: Selection, timeout: float,
                            settle_timeout: float, progress=None, reference: str | None = None,
                            kv_tolerance: float | None = None) -> list[CaseResult]:
    options = [("grpc.max_receive_message_length", 256 << 20)]
    async with contextlib.AsyncExitStack() as stack:
        channel = await stack.enter_async_context(grpc.aio.insecure_channel(target, options))
        info = await _info(channel, timeout)
        trusted = None
        if reference:
            ref_channel = await stack.enter_async_context(
                grpc.aio.insecure_channel(reference, options))
            trusted = ReferencePrefill(ref_channel, await _info(ref_channel, timeout))
        pool = PoolWatch(channel)
        await pool.take_baseline()
        t = PrefillTarget(channel, info, pool, timeout, trusted, kv_tolerance)
        return await run_cases(prefill_cases(), t, selection,
                               lambda: pool.settled(settle_timeout), progress)
