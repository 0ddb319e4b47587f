"""`kvhandoff conformance decode`: the suite serves a scripted fake prefill (a proxy in front of
a real reference prefill) and drives the decode under test, which was started with
`--prefill` = the fake's address. One case at a time: set the script, call Generate, check the
status, the ErrorInfo reason, that no token came out, that decode ended its prefill call, and
that decode's pool (StatsService) is back at baseline.
"""

from __future__ import annotations

import asyncio
import sys
import time
import zlib
from dataclasses import dataclass, field

import grpc

from common.handoff.layout import kv_bytes_per_token_per_layer
from common.pb.kvhandoff.v1 import common_pb2, generate_pb2, generate_pb2_grpc, handoff_pb2
from common.server.wait import wait_serving
from conformance.binding import MIN_NONCE_BYTES
from conformance.decode_cases import STALL_SECONDS, decode_cases
from conformance.decode_edits import refusal_then_silence
from conformance.decode_plane_cases import shared_memory_cases
from conformance.decode_script import INLINE, DecodeCase, Expect, refused, tokens
from conformance.fake_prefill import Exchange, FakePrefill, passthrough
from conformance.pool import PoolWatch
from conformance.report import CaseResult, Selection
from conformance.runner import Case, NotApplicable, prompt_ids, run_cases
from conformance.spec import DEFAULT_MAX_CHUNK_BYTES, ERROR_DOMAIN, PROTOCOL_MAJOR
from conformance.wire import RpcOutcome, outcome_of

C = grpc.StatusCode
MAX_TOKENS = 2
CANCEL_WITHIN_S = 1.0  # D-29
CANCEL_CASE_DEADLINE_S = 10.0  # a decode that misses the bad crc fails the case in 10 s, not 120


@dataclass
class DecodeTarget:
    channel: grpc.aio.Channel
    fake: FakePrefill
    pool: PoolWatch
    timeout: float
    settle_timeout: float
    max_prompt_tokens: int = 0
    negotiated_max_chunk: int = DEFAULT_MAX_CHUNK_BYTES
    vocab_size: int = 0
    context_window: int = 0  # the smaller of decode's and the prefill's max_context_tokens
    prefill_max_prompt: int = 0  # the longest prompt decode may forward (its and prefill's pools)
    page_size: int = 16
    data_plane: int = INLINE  # the plane decode's requests name (learned from the first one)

    def oversize_prompt_tokens(self) -> int:
        """A prompt long enough for one layout-consistent chunk over the negotiated maximum,
        when decode's limits allow it (else the usual length; the case then pads a chunk)."""
        need = self.negotiated_max_chunk // kv_bytes_per_token_per_layer(self.fake.info.layout) + 1
        return need if need <= self.max_prompt_tokens else 24


@dataclass
class CaseRun:
    """What one Generate call through the fake did."""

    prompt: list[int]
    tokens: list[int]
    outcome: RpcOutcome
    exchanges: list[Exchange] = field(default_factory=list)
    ended_at: float = 0.0  # time.monotonic() when the Generate call ended


async def generate(t: DecodeTarget, prompt: list[int], deadline: float | None,
                   cache_salt: str = "") -> CaseRun:
    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt), max_tokens=MAX_TOKENS, ignore_eos=True,
        sampling=common_pb2.SamplingParams(temperature=0.0), cache_salt=cache_salt)
    run = CaseRun(prompt, [], RpcOutcome(grpc.StatusCode.OK))
    call = generate_pb2_grpc.GenerationServiceStub(t.channel).Generate(
        request, timeout=deadline or t.timeout)
    try:
        async for response in call:
            if response.HasField("token"):
                run.tokens.append(response.token.token_id)
    except grpc.aio.AioRpcError as err:
        run.outcome = outcome_of(err)
    run.ended_at = time.monotonic()
    return run


async def play(t: DecodeTarget, case: DecodeCase, cache_salt: str = "") -> CaseRun:
    """Runs one case's Generate call with its script in place; returns what happened."""
    n = case.prompt_tokens(t) if callable(case.prompt_tokens) else case.prompt_tokens
    prompt = prompt_ids(n, t.vocab_size, zlib.crc32(case.case_id.encode()))
    t.fake.exchanges.clear()
    t.fake.script = case.script
    t.fake.decoy = case.decoy
    try:
        run = await generate(t, prompt, case.deadline, cache_salt)
    finally:
        t.fake.decoy = None
    run.exchanges = list(t.fake.exchanges)
    for exchange in run.exchanges:  # decode must have ended (or cancelled) its prefill call
        try:
            await asyncio.wait_for(exchange.done.wait(), t.settle_timeout)
        except asyncio.TimeoutError:
            pass
    t.fake.script = passthrough
    return run


def check_run(case: DecodeCase, run: CaseRun) -> list[str]:
    problems: list[str] = []
    if not run.exchanges:
        return [f"[D-03] decode never called the fake prefill ({run.outcome.describe()})"]
    first = run.exchanges[0]
    if first.error:
        return [f"suite could not script the case: {first.error}"]
    if not all(e.done.is_set() for e in run.exchanges):
        problems.append("[D-24] decode left its prefill call open after the request ended")
    expect, out = case.expect, run.outcome
    if expect.code is None:
        honest = first.reference_first_token
        if out.code != grpc.StatusCode.OK:
            problems.append(f"[D-25] a good handoff failed: {out.describe()}")
        elif not run.tokens:
            problems.append("[D-25] a good handoff produced no token")
        elif honest is not None and run.tokens[0] != honest:
            problems.append(f"[D-48] first token {run.tokens[0]} is not the honest prefill's "
                            f"{honest} (decode must stream its own, never a forged one)")
        return problems
    if run.tokens:
        problems.append(f"[D-24] {len(run.tokens)} token(s) emitted for a refused handoff")
    reason_ok = out.reason == expect.reason or (expect.reason_optional and out.reason is None)
    if out.code != expect.code or not reason_ok:
        problems.append(f"[{case.rule}] got {out.describe()}; expected {expect.code.name} "
                        f"reason={expect.reason}")
    elif out.reason is not None and out.domain != ERROR_DOMAIN:
        problems.append(f"[G-05] ErrorInfo domain {out.domain!r}, expected {ERROR_DOMAIN!r}")
    return problems


def plane_name(plane: int) -> str:
    return handoff_pb2.DataPlane.Name(plane).removeprefix("DATA_PLANE_")


def _as_case(case: DecodeCase) -> Case[DecodeTarget]:
    async def run(t: DecodeTarget) -> list[str]:
        if t.data_plane not in case.planes:
            raise NotApplicable(f"decode asks for {plane_name(t.data_plane)}; the case needs "
                                f"{' or '.join(plane_name(p) for p in case.planes)}")
        return check_run(case, await play(t, case))
    return Case(case.case_id, case.rule, case.level, case.expectation, run)


async def _request_well_formed(t: DecodeTarget) -> list[str]:
    runs = [await play(t, DecodeCase("request_well_formed", "D-03", "MUST", "", passthrough,
                                     tokens(), prompt_tokens=5 + k)) for k in range(2)]
    problems, ids, nonces = [], [], []
    for run in runs:
        if not run.exchanges:
            return [f"[D-03] decode never called the fake prefill ({run.outcome.describe()})"]
        r = run.exchanges[0].request
        ids.append(r.request_id)
        nonces.append(r.nonce)
        if r.protocol_version.minor < 1 or len(r.nonce) < MIN_NONCE_BYTES:
            problems.append(f"[D-40] PrefillRequest speaks 1.{r.protocol_version.minor} with a "
                            f"{len(r.nonce)}-byte nonce; 1.1 needs at least {MIN_NONCE_BYTES}")
        if list(r.token_ids) != run.prompt:
            problems.append(f"[D-03] PrefillRequest token_ids {list(r.token_ids)[:8]}... are "
                            f"not the client's prompt {run.prompt[:8]}...")
        if r.protocol_version.major != PROTOCOL_MAJOR:
            problems.append(f"[D-03] PrefillRequest protocol major {r.protocol_version.major}")
        if r.model_fingerprint != t.fake.info.model_fingerprint:
            problems.append(f"[D-03] PrefillRequest model {r.model_fingerprint!r} is not the "
                            f"served model {t.fake.info.model_fingerprint!r}")
    if not all(ids) or len(set(ids)) != len(ids):
        problems.append(f"[D-03] request ids {ids} are not non-empty and unique")
    if len(set(nonces)) != len(nonces):
        problems.append("[D-40] two handoffs carried the same nonce")
    return problems


def _forwarded_problems(run: CaseRun) -> list[str]:
    return [f"[D-03] PrefillRequest has {len(e.request.token_ids)} token ids, not exactly the "
            f"client's prompt of {len(run.prompt)}" for e in run.exchanges
            if list(e.request.token_ids) != run.prompt]


async def _long_prompt_forwarded(t: DecodeTarget) -> list[str]:
    n = min(t.max_prompt_tokens, t.prefill_max_prompt, 8 * t.page_size + 3)
    case = DecodeCase("request_long_prompt", "D-03", "MUST", "", passthrough, tokens(),
                      prompt_tokens=n)
    run = await play(t, case)
    return _forwarded_problems(run) + check_run(case, run)


def _over_limit_case(case_id: str, summary: str, expect: Expect, length) -> Case[DecodeTarget]:
    """A prompt over decode's limits: refused with `expect`, and prefill never called."""
    async def run(t: DecodeTarget) -> list[str]:
        n = length(t)
        run = await play(t, DecodeCase(case_id, "D-28", "MUST", "", passthrough, expect,
                                       prompt_tokens=n))
        problems = [f"[D-28] decode called prefill with {len(e.request.token_ids)} of the "
                    f"{n} tokens of a prompt over its limits" for e in run.exchanges]
        if run.tokens:
            problems.append(f"[D-28] {len(run.tokens)} token(s) emitted for a prompt of {n}")
        out = run.outcome
        if (out.code, out.reason) != (expect.code, expect.reason):
            problems.append(f"[D-28] {n} tokens: got {out.describe()}; expected "
                            f"{expect.code.name} reason={expect.reason}")
        elif out.domain != ERROR_DOMAIN:
            problems.append(f"[G-05] ErrorInfo domain {out.domain!r}, expected {ERROR_DOMAIN!r}")
        return problems
    return Case(case_id, "D-28", "MUST", f"{summary} -> {expect.describe()}, no Prefill call",
                run)


def _beyond_prefill_pool(t: DecodeTarget) -> int:
    n = t.prefill_max_prompt + 1
    if n + MAX_TOKENS - 1 > t.context_window:
        raise NotApplicable(f"the prompt limit {t.prefill_max_prompt} is the window "
                            f"{t.context_window}: no prompt is inside it but beyond the pools")
    return n


async def _cancel_after_refusal(t: DecodeTarget) -> list[str]:
    case = DecodeCase("cancel_after_refusal", "D-29", "MUST", "",
                      lambda i: refusal_then_silence(i, STALL_SECONDS),
                      refused("CHECKSUM_MISMATCH"), deadline=CANCEL_CASE_DEADLINE_S)
    run = await play(t, case)
    problems = check_run(case, run)
    for e in run.exchanges:
        if not e.cancelled:
            problems.append("[D-29] decode did not cancel its prefill call after refusing")
        elif e.cancelled_at - run.ended_at > CANCEL_WITHIN_S:
            problems.append(f"[D-29] decode cancelled its prefill call "
                            f"{e.cancelled_at - run.ended_at:.2f}s after refusing (limit "
                            f"{CANCEL_WITHIN_S:g}s)")
    return problems


async def _cache_scope_computed(t: DecodeTarget) -> list[str]:
    """D-80 on an unauthenticated call: no salt, no scope; a salt gives a scope that is not the
    salt as sent, the same for the same salt, another for another salt."""
    scopes = []
    for salt in ("", "tenant-salt-1", "tenant-salt-1", "tenant-salt-2"):
        case = DecodeCase("cache_scope_computed", "D-80", "MUST", "", passthrough, tokens(),
                          prompt_tokens=5)
        run = await play(t, case, salt)
        if not run.exchanges:
            return [f"[D-80] decode never called the fake prefill ({run.outcome.describe()})"]
        scopes.append(run.exchanges[0].request.cache_scope)
    problems = []
    if scopes[0]:
        problems.append("[D-80] a call with neither identity nor salt carried a cache_scope")
    if not scopes[1] or scopes[1] != scopes[2]:
        problems.append("[D-80] one salt gave no scope, or two different scopes")
    if scopes[1] == scopes[3]:
        problems.append("[D-80] two salts gave the same cache_scope")
    if any(scope in (b"tenant-salt-1", b"tenant-salt-2") for scope in scopes):
        problems.append("[D-80] decode passed the client's salt through as the scope")
    return problems


def suite_cases(stall_deadline: float = 3.0) -> list[Case[DecodeTarget]]:
    """Every case of the decode suite, in the order run."""
    return [
        Case("request_well_formed", "D-03", "MUST", "PrefillRequest carries the prompt, "
             "protocol 1, the model and a fresh request id", _request_well_formed),
        Case("request_long_prompt", "D-03", "MUST", "a prompt of 8 pages + 3 tokens is "
             "forwarded exactly and served", _long_prompt_forwarded),
        _over_limit_case("prompt_over_window", "window + 1 tokens",
                         Expect(C.INVALID_ARGUMENT, "PROMPT_TOO_LONG"),
                         lambda t: t.context_window + 1),
        _over_limit_case("prompt_beyond_prefill_pool", "prefill's max_prompt_tokens + 1, inside "
                         "the window", Expect(C.RESOURCE_EXHAUSTED, "POOL_TOO_SMALL"),
                         _beyond_prefill_pool),
        Case("cancel_after_refusal", "D-29", "MUST", "a bad crc32c, then the stream stays open: "
             f"refused, and the prefill call cancelled within {CANCEL_WITHIN_S:g}s",
             _cancel_after_refusal),
        Case("cache_scope_computed", "D-80", "MUST", "cache_scope: empty without identity or "
             "salt; decode's own hash of the salt, equal for equal salts, never the salt",
             _cache_scope_computed),
        *(_as_case(c) for c in decode_cases(stall_deadline)),
        *(_as_case(c) for c in shared_memory_cases()),
    ]


async def open_target(decode: str, fake: FakePrefill, timeout: float, settle_timeout: float,
                      wait: float) -> DecodeTarget:
    """Waits for the decode to serve, takes its pool baseline and learns its limits."""
    channel = grpc.aio.insecure_channel(decode, options=[  # the decode may start after us
        ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 1000)])
    try:  # in a thread: the fake prefill on this event loop must keep answering meanwhile
        await asyncio.to_thread(wait_serving, decode, wait)
    except TimeoutError as err:
        raise TimeoutError(f"decode {err}; was it started with --prefill pointing at the "
                           f"fake's listen address?") from err
    pool = PoolWatch(channel)
    base = await pool.take_baseline()
    t = DecodeTarget(channel, fake, pool, timeout, settle_timeout,
                     max_prompt_tokens=int(min(base.max_prompt_tokens,
                                               base.max_context_tokens - MAX_TOKENS)),
                     vocab_size=fake.info.vocab_size,
                     context_window=int(min(base.max_context_tokens,
                                            fake.info.max_context_tokens)),
                     prefill_max_prompt=int(min(base.max_prompt_tokens or sys.maxsize,
                                                fake.info.max_prompt_tokens)),
                     page_size=int(base.page_size or fake.info.page_size))
    probe = await play(t, decode_cases()[0])  # learns decode's max_chunk_bytes
    if probe.exchanges and probe.exchanges[0].request.max_chunk_bytes:
        t.negotiated_max_chunk = probe.exchanges[0].request.max_chunk_bytes
    if probe.exchanges:
        t.data_plane = probe.exchanges[0].request.data_plane or INLINE
    await pool.settled(settle_timeout)
    return t


async def run_decode_suite(decode: str, listen: str, reference: str, selection: Selection,
                           timeout: float, settle_timeout: float, wait: float,
                           stall_deadline: float, progress=None,
                           shm_dir: str = "/dev/shm") -> list[CaseResult]:
    fake = FakePrefill(reference, shm_dir)
    await fake.start(listen)
    try:
        t = await open_target(decode, fake, timeout, settle_timeout, wait)
        try:
            return await run_cases(suite_cases(stall_deadline), t, selection,
                                   lambda: t.pool.settled(settle_timeout), progress)
        finally:
            await t.channel.close()
    finally:
        await fake.stop()
