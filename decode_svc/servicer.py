"""The GenerationService on decode: validate, reserve, pull and verify the handoff, generate.

Whatever ends a request (done, refused, client gone, deadline), `finally` releases its pages.
How the KV reaches the pages is the receiver's business (decode_svc.kv_receiver: inline gRPC
bytes, shared memory, or --local-prefill where the engine computes it itself); the servicer runs
the content checks on whatever a peer sent, and never asks which receiver it holds.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

import grpc

from common.counters import Counters
from common.errors import ServiceError, abort_with
from common.handoff.binding import new_nonce, prompt_digest
from common.handoff.layout import KvLayout, protocol_version
from common.handoff.reasons import HandoffRefused
from common.handoff.transfer import TransferRecord
from common.handoff.verifier import Expectation
from common.pb.kvhandoff.v1 import generate_pb2, generate_pb2_grpc, handoff_pb2
from common.sampling import SamplingConfig
from common.text.detokenizer import IncrementalDetokenizer
from common.text.stop_strings import StopStrings
from common.tokenizer import Tokenizer
from decode_svc.engine import DecodeEngine
from decode_svc.engine_answer import engine_answer
from decode_svc.cache_scope import cache_scope, no_identity
from decode_svc.content_check import ContentVerdict
from decode_svc.handoff import HandoffPolicy, InlineReceiver
from decode_svc.kv_receiver import HandoffJob, KvReceiver, LandedKv
from decode_svc.prefill_client import PrefillClient
from decode_svc.sequence import FailedEvent, FinishedEvent, Sequence, TokenEvent
from decode_svc.state import DecodeState
from decode_svc.validation import (DecodeLimits, prompt_ids, validate_generate,
                                   validate_stop_strings)

FINISH = {"stop": generate_pb2.FINISH_REASON_STOP, "length": generate_pb2.FINISH_REASON_LENGTH}


class GenerationServicer(generate_pb2_grpc.GenerationServiceServicer):
    def __init__(self, engine: DecodeEngine, client: PrefillClient, state: DecodeState,
                 layout: KvLayout, fingerprint: str, tokenizer: Tokenizer | None,
                 eos_ids: tuple[int, ...], max_chunk_bytes: int, handoff_timeout_s: float,
                 refusals: Counters, metrics, log,
                 policy: HandoffPolicy | None = None,
                 receiver: KvReceiver | None = None,
                 identity: Callable[[object], bytes] = no_identity) -> None:
        self.identity = identity  # context -> the caller's authenticated identity
        self.engine = engine
        self.receiver = receiver or InlineReceiver(client, engine)
        self.policy = policy or HandoffPolicy()
        self.client = client
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

    def _limits(self) -> DecodeLimits:
        if self.state.refusing:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, "PREFILL_MISMATCH",
                               self.state.refusing)
        if self.state.limits is None:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "PREFILL_NOT_READY",
                               "decode has not completed its handshake with prefill yet")
        return self.state.limits

    async def Generate(self, request: generate_pb2.GenerateRequest, context):
        request_id = uuid.uuid4().hex
        log = self.log.bind(request_id=request_id)
        received = time.monotonic()
        try:
            limits = self._limits()
            prompt = validate_generate(prompt_ids(request, self.tokenizer), request, limits)
            stops = validate_stop_strings(request, self.tokenizer)
        except ServiceError as err:
            log.warning("request_refused", reason=err.reason, message=err.message)
            self.metrics.refused(err.reason)
            await abort_with(context, err)
            return
        events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        emit = lambda event: loop.call_soon_threadsafe(events.put_nowait, event)  # noqa: E731
        sampling = SamplingConfig.from_proto(request.sampling, uuid.uuid4().int & (2**63 - 1))
        try:
            await self._reserve(request_id, prompt.reserve_tokens)
            queued = time.monotonic()
            nonce = new_nonce()
            handoff_request = handoff_pb2.PrefillRequest(
                request_id=request_id, token_ids=prompt.token_ids,
                protocol_version=protocol_version(), model_fingerprint=self.fingerprint,
                sampling=sampling.to_proto(), max_chunk_bytes=self.max_chunk_bytes, nonce=nonce,
                cache_scope=cache_scope(self.identity(context),
                                        request.cache_salt))
            expect = Expectation(request_id, len(prompt.token_ids), self.layout, self.fingerprint,
                                 self.max_chunk_bytes, limits.vocab_size, nonce,
                                 prompt_digest(prompt.token_ids), self.policy.allow_protocol_1_0)
            remaining = context.time_remaining()
            timeout = (self.handoff_timeout_s if remaining is None
                       else min(remaining, self.handoff_timeout_s))
            record = TransferRecord(request_id, self.receiver.plane)
            landed = await self.receiver.receive(
                HandoffJob(handoff_request, expect, sampling, timeout), record)
            first, nbytes = (landed.first_token if landed.own_kv else await self._check_content(
                landed, request_id, prompt.token_ids, sampling, log)), landed.payload_bytes
            handed = time.monotonic()
            log.info("prefilled_locally" if landed.own_kv else "handoff_verified",
                     prompt_tokens=len(prompt.token_ids), bytes=nbytes, plane=record.plane,
                     seconds=round(handed - queued, 4))
            self.metrics.handoff(handed - queued, nbytes, queued - received)
            self.metrics.admitted(len(prompt.token_ids))
            stop_ids = frozenset(request.stop_token_ids) | (
                frozenset() if request.ignore_eos else frozenset(self.eos_ids))
            self.engine.begin(Sequence(request_id, len(prompt.token_ids),
                                       prompt.token_ids + [first], prompt.max_tokens, sampling,
                                       stop_ids, emit))
            async for response in self._stream(events, request_id, len(prompt.token_ids), received,
                                               StopStrings(stops)):
                yield response
            log.info("request_finished", seconds=round(time.monotonic() - received, 4))
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
            await abort_with(context, err)
        except ServiceError as err:
            log.warning("request_failed", reason=err.reason, message=err.message)
            self.metrics.refused(err.reason)
            self.metrics.ended("error")
            await abort_with(context, err)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # never UNKNOWN without details: INTERNAL with ErrorInfo
            log.exception("request_crashed", error=str(exc))
            self.metrics.ended("error")
            await abort_with(context, ServiceError(grpc.StatusCode.INTERNAL, "INTERNAL",
                                                   f"decode failed: {exc}"))
        finally:
            self.engine.release(request_id)

    async def _check_content(self, handoff: LandedKv, request_id: str,
                             token_ids: list[int], sampling: SamplingConfig, log) -> int:
        """The KV content checks (raise HandoffRefused); returns the first token to stream:
        decode's own, from its own logits. Prefill's first_token_id is only compared."""
        counters = self.engine.counters
        if not handoff.bound:
            counters.add("handoffs_protocol_1_0")
        if not self.policy.content.enabled:
            return handoff.advisory_first_token
        verdict: ContentVerdict = await engine_answer(
            lambda done: self.engine.verify(request_id, token_ids, sampling, done))
        log.info("handoff_content_verified", prompt_tokens=len(token_ids),
                 layer0_error=round(verdict.layer0_error, 8),
                 depth_error=round(verdict.depth_error, 8), positions=list(verdict.positions),
                 seconds=round(verdict.seconds, 5))
        if verdict.first_token_id != handoff.advisory_first_token:
            counters.add("first_token_disagreements")
            log.warning("first_token_disagrees", prefill_first_token=handoff.advisory_first_token,
                        decode_first_token=verdict.first_token_id,
                        message="prefill's first_token_id differs from decode's own; decode's "
                                "is streamed")
        return verdict.first_token_id

    async def _reserve(self, request_id: str, num_tokens: int) -> None:
        await engine_answer(lambda done: self.engine.reserve(request_id, num_tokens, done))

    async def _stream(self, events: asyncio.Queue, request_id: str, prompt_len: int,
                      received: float, stops: StopStrings):
        """Token events -> responses. A stop string ends the stream here (the caller's finally
        releases the sequence); the text held back at the end goes in GenerationFinished."""
        detok = IncrementalDetokenizer(self.tokenizer)
        last = first_at = received

        def finished(reason: str, completion_tokens: int, text: str):
            self.metrics.finished(time.monotonic() - received, reason, prompt_len,
                                  completion_tokens, last - first_at)
            usage = generate_pb2.Usage(prompt_tokens=prompt_len,
                                       completion_tokens=completion_tokens)
            return generate_pb2.GenerateResponse(finished=generate_pb2.GenerationFinished(
                finish_reason=FINISH[reason], usage=usage, request_id=request_id, text=text))

        while True:
            event = await events.get()
            if isinstance(event, TokenEvent):
                now = time.monotonic()
                self.metrics.token(now - last, first=event.index == 0)
                last, first_at = now, (now if event.index == 0 else first_at)
                check = stops.feed(detok.push(event.token_id))
                yield generate_pb2.GenerateResponse(token=generate_pb2.GeneratedToken(
                    token_id=event.token_id, text=check.text, index=event.index))
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
