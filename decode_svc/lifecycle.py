"""One request's life on decode, shared by both front doors (gRPC Generate and the
OpenAI-compatible HTTP API): admit -> hand off -> verify -> join the batch -> stream -> finish.

Each stage is one method with its own errors: `admit` validates against decode's limits
(ServiceError, nothing reserved), `_hand_off` reserves pages and lands the KV through the
receiver (HandoffRefused), the content gate recomputes and compares (HandoffRefused; inside each
attempt when the retry wraps the receiver, so that a content refusal is retried on another
replica: decode_svc/content_gate.py), `_join`
puts the sequence in the running batch, `_stream` turns engine events into transport-neutral
`Token`/`Finished` events. `generate` runs the stages, logs and counts every ending once, and
raises a ServiceError for the adapter to put on its wire (gRPC status, HTTP error object).
Whatever ends a request (done, refused, client gone, deadline), its `finally` releases the
pages. Neither adapter knows which KV receiver the lifecycle holds.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from common.counters import Counters
from common.errors import ServiceError
from common.handoff.binding import new_nonce, prompt_digest
from common.handoff.layout import KvLayout, protocol_version
from common.handoff.reasons import HandoffRefused
from common.handoff.transfer import TransferRecord
from common.handoff.verifier import Expectation
from common.pb.kvhandoff.v1 import generate_pb2, handoff_pb2
from common.sampling import SamplingConfig
from common.text.detokenizer import IncrementalDetokenizer
from common.text.stop_strings import StopStrings
from common.tokenizer import Tokenizer
from decode_svc.cache_scope import cache_scope
from decode_svc.content_gate import ContentGate
from decode_svc.content_pipeline import ContentPipeline
from decode_svc.engine import DecodeEngine
from decode_svc.engine_answer import engine_answer
from decode_svc.handoff import HandoffPolicy
from decode_svc.kv_receiver import HandoffJob, KvReceiver, LandedKv
from decode_svc.sequence import FailedEvent, FinishedEvent, Sequence, TokenEvent
from decode_svc.state import DecodeState
from decode_svc.validation import (DecodeLimits, ValidPrompt, prompt_ids, validate_generate,
                                   validate_stop_strings)


@dataclass(frozen=True)
class Admitted:
    """A request that passed decode's checks; nothing is reserved for it yet."""

    request_id: str
    prompt: ValidPrompt
    limits: DecodeLimits  # as agreed when it was admitted
    stops: list[str]
    sampling: SamplingConfig
    stop_ids: frozenset[int]
    cache_scope: bytes
    received: float  # time.monotonic() when it arrived
    log: object


@dataclass(frozen=True)
class Token:
    token_id: int
    text: str  # the text this token makes final (may be empty: held back)
    index: int


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop" or "length"
    prompt_tokens: int
    completion_tokens: int
    text: str  # the text still held back when generation ended
    request_id: str
    # prompt tokens prefill served from its prefix cache (D-90): whole pages, < prompt_tokens
    cached_tokens: int = 0


Event = Token | Finished


def handoff_timeline(received: float, reserved: float, record: TransferRecord,
                     handed: float, pipeline: ContentPipeline | None = None
                     ) -> dict[str, float]:
    """Milliseconds from the request's arrival to each milestone of its hand-off that was
    reached (the first attempt's receiver marks; when the checks run as the KV landed ended),
    in time order, then `verified` (form and content checked): where a request's time before
    its first token went."""
    marks = {"reserved": reserved, **record.marks, "verified": handed}
    if pipeline is not None and pipeline.done_at is not None:
        marks["checks_landed"] = pipeline.done_at
    return {name: round((at - received) * 1e3, 2)
            for name, at in sorted(marks.items(), key=lambda item: item[1])}


class RequestLifecycle:
    def __init__(self, engine: DecodeEngine, receiver: KvReceiver, state: DecodeState,
                 layout: KvLayout, fingerprint: str, tokenizer: Tokenizer | None,
                 eos_ids: tuple[int, ...], max_chunk_bytes: int, handoff_timeout_s: float,
                 refusals: Counters, metrics, log, policy: HandoffPolicy) -> None:
        self.engine = engine
        self.receiver = receiver
        self.state = state
        self.layout = layout
        self.fingerprint = fingerprint
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_chunk_bytes = max_chunk_bytes
        self.handoff_timeout_s = handoff_timeout_s
        self.refusals = refusals
        self.metrics = metrics
        self.log = log
        self.policy = policy
        self.content = ContentGate(engine, policy)

    def limits(self) -> DecodeLimits:
        if self.state.refusing:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, "PREFILL_MISMATCH",
                               self.state.refusing)
        if self.state.limits is None:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "PREFILL_NOT_READY",
                               "decode has not completed its handshake with prefill yet")
        return self.state.limits

    def admit(self, request: generate_pb2.GenerateRequest, identity: bytes) -> Admitted:
        """Stage 1: the request checked against decode's limits; a refusal is logged, counted
        and raised (ServiceError) before anything is reserved."""
        request_id = uuid.uuid4().hex
        log = self.log.bind(request_id=request_id)
        received = time.monotonic()
        try:
            limits = self.limits()
            prompt = validate_generate(prompt_ids(request, self.tokenizer), request, limits)
            stops = validate_stop_strings(request, self.tokenizer)
        except ServiceError as err:
            log.warning("request_refused", reason=err.reason, message=err.message)
            self.metrics.refused(err.reason)
            raise
        sampling = SamplingConfig.from_proto(request.sampling, uuid.uuid4().int & (2**63 - 1))
        stop_ids = frozenset(request.stop_token_ids) | (
            frozenset() if request.ignore_eos else frozenset(self.eos_ids))
        return Admitted(request_id, prompt, limits, stops, sampling, stop_ids,
                        cache_scope(identity, request.cache_salt), received, log)

    async def generate(self, admitted: Admitted, time_remaining: float | None
                       ) -> AsyncIterator[Event]:
        """Stages 2-6 of an admitted request; time_remaining is the caller's deadline (None:
        none). Raises ServiceError (HandoffRefused included) for the adapter to send; a
        cancellation (client gone, deadline) is logged and re-raised. The pages are released
        however this ends, also when the caller closes the iterator early."""
        log, received = admitted.log, admitted.received
        events: asyncio.Queue = asyncio.Queue()
        try:
            landed = await self._hand_off(admitted, time_remaining)
            self._join(admitted, landed.first_token, events)
            first_token_at = None
            async for event in self._stream(events, admitted.request_id,
                                            len(admitted.prompt.token_ids), received,
                                            StopStrings(admitted.stops), landed.cached_tokens):
                first_token_at = first_token_at or time.monotonic()
                yield event
            log.info("request_finished", seconds=round(time.monotonic() - received, 4),
                     first_token_ms=(None if first_token_at is None else
                                     round((first_token_at - received) * 1e3, 2)))
        except (asyncio.CancelledError, GeneratorExit):  # client gone (Ctrl-C) or deadline
            log.info("request_cancelled", seconds=round(time.monotonic() - received, 4))
            self.metrics.ended("cancelled")
            raise
        except HandoffRefused as err:
            self.refusals.add(err.reason)
            log.warning("handoff_refused", reason=err.reason, code=err.code.name,
                        message=err.message)
            self.metrics.refused(err.reason)
            self.metrics.ended("error")
            raise
        except ServiceError as err:
            log.warning("request_failed", reason=err.reason, message=err.message)
            self.metrics.refused(err.reason)
            self.metrics.ended("error")
            raise
        except Exception as exc:  # never UNKNOWN without details: INTERNAL with a reason
            log.exception("request_crashed", error=str(exc))
            self.metrics.ended("error")
            raise ServiceError(grpc.StatusCode.INTERNAL, "INTERNAL",
                               f"decode failed: {exc}") from exc
        finally:
            self.engine.release(admitted.request_id)

    async def _hand_off(self, admitted: Admitted, time_remaining: float | None) -> LandedKv:
        """Stages 2-3: reserve the pages, land the KV through the receiver, check its content
        (unless the receiver chain did); returns the landing, whose first token is the one to
        stream (decode's own)."""
        request_id, prompt, sampling = admitted.request_id, admitted.prompt, admitted.sampling
        await self._reserve(request_id, prompt.reserve_tokens)
        queued = time.monotonic()
        nonce = new_nonce()
        handoff_request = handoff_pb2.PrefillRequest(
            request_id=request_id, token_ids=prompt.token_ids,
            protocol_version=protocol_version(), model_fingerprint=self.fingerprint,
            sampling=sampling.to_proto(), max_chunk_bytes=self.max_chunk_bytes, nonce=nonce,
            cache_scope=admitted.cache_scope)
        expect = Expectation(request_id, len(prompt.token_ids), self.layout, self.fingerprint,
                             self.max_chunk_bytes, admitted.limits.vocab_size, nonce,
                             prompt_digest(prompt.token_ids), self.policy.allow_protocol_1_0,
                             cache_page_size=admitted.limits.prefill_page_size)
        timeout = (self.handoff_timeout_s if time_remaining is None
                   else min(time_remaining, self.handoff_timeout_s))
        content = self.policy.content
        # the first attempt's checks run layer by layer as its KV lands (a retry's, after it)
        pipeline = (ContentPipeline(self.engine, request_id, list(prompt.token_ids),
                                    content.depth_positions) if content.enabled else None)
        record = TransferRecord(request_id, self.receiver.plane,
                                on_chunk=pipeline.on_chunk if pipeline else None)
        job = HandoffJob(handoff_request, expect, sampling, timeout,
                         check=lambda kv, attempt: self.content.check(
                             kv, attempt, admitted.log, pipeline if attempt is job else None))
        landed = await self.content.check(await self.receiver.receive(job, record), job,
                                          admitted.log, pipeline)  # no-op if an attempt ran it
        handed = time.monotonic()
        admitted.log.info("prefilled_locally" if landed.own_kv else "handoff_verified",
                          prompt_tokens=len(prompt.token_ids), bytes=landed.payload_bytes,
                          cached_tokens=landed.cached_tokens, plane=record.plane,
                          seconds=round(handed - queued, 4),
                          timeline_ms=handoff_timeline(admitted.received, queued, record,
                                                       handed, pipeline))
        self.metrics.handoff(handed - queued, landed.payload_bytes, queued - admitted.received)
        return landed

    def _join(self, admitted: Admitted, first: int, events: asyncio.Queue) -> None:
        """Stage 4: the verified sequence joins the running batch; its events reach `events`
        (at most max_tokens of them, so the queue is bounded by the request itself)."""
        loop = asyncio.get_running_loop()
        emit = lambda event: loop.call_soon_threadsafe(events.put_nowait, event)  # noqa: E731
        prompt = admitted.prompt
        self.metrics.admitted(len(prompt.token_ids))
        self.engine.begin(Sequence(admitted.request_id, len(prompt.token_ids),
                                   prompt.token_ids + [first], prompt.max_tokens,
                                   admitted.sampling, admitted.stop_ids, emit))

    async def _reserve(self, request_id: str, num_tokens: int) -> None:
        await engine_answer(lambda done: self.engine.reserve(request_id, num_tokens, done))

    async def _stream(self, events: asyncio.Queue, request_id: str, prompt_len: int,
                      received: float, stops: StopStrings, cached_tokens: int = 0
                      ) -> AsyncIterator[Event]:
        """Stage 5-6: engine events -> Token/Finished. A stop string ends the stream here (the
        caller's finally releases the sequence); the text held back goes in Finished."""
        detok = IncrementalDetokenizer(self.tokenizer)
        last = first_at = received

        def finished(reason: str, completion_tokens: int, text: str) -> Finished:
            self.metrics.finished(time.monotonic() - received, reason, prompt_len,
                                  completion_tokens, last - first_at)
            return Finished(reason, prompt_len, completion_tokens, text, request_id,
                            cached_tokens)

        while True:
            event = await events.get()
            if isinstance(event, TokenEvent):
                now = time.monotonic()
                self.metrics.token(now - last, first=event.index == 0)
                last, first_at = now, (now if event.index == 0 else first_at)
                check = stops.feed(detok.push(event.token_id))
                yield Token(event.token_id, check.text, event.index)
                if check.stopped:
                    yield finished("stop", event.index + 1, "")
                    return
            elif isinstance(event, FinishedEvent):
                check = stops.finish(detok.finish())
                yield finished("stop" if check.stopped else event.reason,
                               event.completion_tokens, check.text)
                return
            elif isinstance(event, FailedEvent):
                raise event.error
