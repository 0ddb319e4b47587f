"""The HandoffService on prefill: validates, then relays the engine's frames to decode.

Frames travel as bytes already serialized by the engine thread (`common.handoff.codec`), so the
event loop never serializes a payload. `add_handoff_service` registers Prefill with an identity
response serializer; the other methods keep the generated handlers.
"""

from __future__ import annotations

import asyncio
import uuid

import grpc

from common.capacity import Capacity
from common.counters import Counters
from common.errors import ServiceError, abort_with
from common.handoff.codec import frame_wire, header_frame
from common.handoff.layout import DEFAULT_MAX_CHUNK_BYTES, KvLayout, protocol_version
from common.metrics import NullMetrics
from common.pb.kvhandoff.v1 import handoff_pb2, handoff_pb2_grpc
from common.sampling import SamplingConfig
from prefill_svc.engine import PrefillEngine, PrefillJob
from prefill_svc.validation import PrefillLimits, validate_prefill


class HandoffServicer(handoff_pb2_grpc.HandoffServiceServicer):
    def __init__(self, engine: PrefillEngine, layout: KvLayout, capacity: Capacity,
                 limits: PrefillLimits, refusals: Counters, log, metrics=None) -> None:
        self.engine = engine
        self.layout = layout
        self.capacity = capacity
        self.limits = limits
        self.refusals = refusals
        self.log = log
        self.metrics = metrics if metrics is not None else NullMetrics()
        # True once registered by add_handoff_service: gRPC then sends the bytes as they are.
        # Under the generated registration each frame is parsed back first (slow, but correct).
        self.wire_frames = False

    def _out(self, frame: bytes) -> bytes | handoff_pb2.PrefillResponse:
        return frame if self.wire_frames else handoff_pb2.PrefillResponse.FromString(frame)

    async def GetPrefillInfo(self, request, context) -> handoff_pb2.GetPrefillInfoResponse:
        return handoff_pb2.GetPrefillInfoResponse(
            model_fingerprint=self.limits.model_fingerprint, layout=self.layout.to_proto(),
            page_size=self.capacity.page_size, protocol_versions=[protocol_version()],
            max_prompt_tokens=self.capacity.max_prompt_tokens,
            max_context_tokens=self.capacity.context_window, vocab_size=self.limits.vocab_size)

    async def Prefill(self, request: handoff_pb2.PrefillRequest, context):
        log = self.log.bind(request_id=request.request_id, prompt_tokens=len(request.token_ids))
        rejection = validate_prefill(request, self.limits)
        fingerprint = self.limits.model_fingerprint
        if rejection is not None:
            self.refusals.add(rejection.reason_code)
            log.warning("prefill_rejected", reason=rejection.reason_code, message=rejection.message)
            self.metrics.refused(rejection.reason_code)
            yield self._out(frame_wire(header_frame(
                request.request_id, len(request.token_ids), handoff_pb2.HANDOFF_STATUS_REJECTED,
                None, fingerprint, rejection.message, rejection.reason_code)))
            await abort_with(context, ServiceError(rejection.code, rejection.reason_code,
                                                   rejection.message))
            return
        loop = asyncio.get_running_loop()
        frames: asyncio.Queue = asyncio.Queue()
        max_chunk = request.max_chunk_bytes or DEFAULT_MAX_CHUNK_BYTES
        job = PrefillJob(
            request_id=request.request_id, token_ids=list(request.token_ids),
            sampling=SamplingConfig.from_proto(request.sampling, uuid.uuid4().int & (2**63 - 1)),
            chunk_tokens=self.layout.chunk_tokens(max_chunk),
            emit=lambda frame: loop.call_soon_threadsafe(frames.put_nowait, frame))
        yield self._out(frame_wire(header_frame(request.request_id, len(request.token_ids),
                                                handoff_pb2.HANDOFF_STATUS_OK, self.layout,
                                                fingerprint)))
        log.info("prefill_started")
        self.engine.submit(job)
        try:
            while (frame := await frames.get()) is not None:
                yield self._out(frame)
                self.engine.frame_sent(job, len(frame))
            log.info("prefill_streamed", chunks=job.chunks_sent)
        finally:
            if not job.cancelled.is_set():
                job.cancelled.set()  # no-op once the engine is done; stops work when decode left
            self.engine.stream_ended(job)  # frames never sent return their bytes


class _HandlerCapture:
    """Stands in for a server to collect the generated registration's method handlers."""

    def __init__(self) -> None:
        self.service = ""
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.service, self.handlers = service, dict(handlers)


def add_handoff_service(servicer: HandoffServicer, server: grpc.aio.Server) -> None:
    """Registers the HandoffService: the generated handlers, except that Prefill's responses
    are the engine's pre-serialized bytes, passed to gRPC unchanged."""
    capture = _HandlerCapture()
    handoff_pb2_grpc.add_HandoffServiceServicer_to_server(servicer, capture)
    handlers = capture.handlers
    handlers["Prefill"] = grpc.unary_stream_rpc_method_handler(
        servicer.Prefill, request_deserializer=handoff_pb2.PrefillRequest.FromString,
        response_serializer=None)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(capture.service, handlers),))
    server.add_registered_method_handlers(capture.service, handlers)
    servicer.wire_frames = True
