"""The GenerationService on decode: the gRPC adapter over the request lifecycle.

The lifecycle (decode_svc.lifecycle: admit -> hand off -> verify -> join -> stream -> finish)
is shared with the OpenAI-compatible HTTP API; this adapter only reads the caller's identity and
deadline from the gRPC context, turns Token/Finished events into GenerateResponse messages, and
ends the call with the lifecycle's ServiceError as a status with ErrorInfo. Whatever ends a
request, the lifecycle releases its pages.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import aclosing

from common.counters import Counters
from common.errors import ServiceError, abort_with
from common.handoff.layout import KvLayout
from common.pb.kvhandoff.v1 import generate_pb2, generate_pb2_grpc
from common.tokenizer import Tokenizer
from decode_svc.cache_scope import no_identity
from decode_svc.engine import DecodeEngine
from decode_svc.handoff import HandoffPolicy, InlineReceiver
from decode_svc.kv_receiver import KvReceiver
from decode_svc.lifecycle import Finished, RequestLifecycle, Token
from decode_svc.prefill_client import PrefillClient
from decode_svc.state import DecodeState

__all__ = ["DecodeState", "GenerationServicer"]

FINISH = {"stop": generate_pb2.FINISH_REASON_STOP, "length": generate_pb2.FINISH_REASON_LENGTH}


def token_response(event: Token) -> generate_pb2.GenerateResponse:
    return generate_pb2.GenerateResponse(token=generate_pb2.GeneratedToken(
        token_id=event.token_id, text=event.text, index=event.index))


def finished_response(event: Finished) -> generate_pb2.GenerateResponse:
    usage = generate_pb2.Usage(prompt_tokens=event.prompt_tokens,
                               completion_tokens=event.completion_tokens,
                               cached_prompt_tokens=event.cached_tokens)
    return generate_pb2.GenerateResponse(finished=generate_pb2.GenerationFinished(
        finish_reason=FINISH[event.reason], usage=usage, request_id=event.request_id,
        text=event.text))


class GenerationServicer(generate_pb2_grpc.GenerationServiceServicer):
    def __init__(self, engine: DecodeEngine, client: PrefillClient, state: DecodeState,
                 layout: KvLayout, fingerprint: str, tokenizer: Tokenizer | None,
                 eos_ids: tuple[int, ...], max_chunk_bytes: int, handoff_timeout_s: float,
                 refusals: Counters, metrics, log,
                 policy: HandoffPolicy | None = None,
                 receiver: KvReceiver | None = None,
                 identity: Callable[[object], bytes] = no_identity) -> None:
        self.identity = identity  # context -> the caller's authenticated identity
        self.lifecycle = RequestLifecycle(
            engine, receiver or InlineReceiver(client, engine), state, layout, fingerprint,
            tokenizer, eos_ids, max_chunk_bytes, handoff_timeout_s, refusals, metrics, log,
            policy or HandoffPolicy())

    async def Generate(self, request: generate_pb2.GenerateRequest, context):
        try:
            admitted = self.lifecycle.admit(request, self.identity(context))
        except ServiceError as err:
            await abort_with(context, err)
            return
        try:
            async with aclosing(self.lifecycle.generate(
                    admitted, context.time_remaining())) as events:
                async for event in events:
                    yield (token_response(event) if isinstance(event, Token)
                           else finished_response(event))
        except ServiceError as err:
            await abort_with(context, err)
