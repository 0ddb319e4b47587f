"""The HandoffService on prefill: validates, then relays the engine's frames to decode.

Frames travel as bytes already serialized by the engine thread (`common.handoff.codec`), so the
event loop never serializes a payload: `add_handoff_service` registers Prefill with no response
serializer (gRPC sends the bytes as they are) and every other method as generated. Log lines of
a request carry the `x-request-id` decode sent (else the PrefillRequest's id), so they join
decode's lines of the same request.
"""

from __future__ import annotations

import asyncio
import uuid

import grpc

from common.capacity import Capacity
from common.counters import Counters
from common.errors import ServiceError, abort_with
from common.handoff.binding import prompt_digest
from common.handoff.codec import frame_wire, header_frame
from common.handoff.layout import DEFAULT_MAX_CHUNK_BYTES, KvLayout, protocol_version
from common.log import request_id_from
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

    async def GetPrefillInfo(self, request, context) -> handoff_pb2.GetPrefillInfoResponse:
        return handoff_pb2.GetPrefillInfoResponse(
            model_fingerprint=self.limits.model_fingerprint, layout=self.layout.to_proto(),
            page_size=self.capacity.page_size, protocol_versions=[protocol_version()],
            max_prompt_tokens=self.capacity.max_prompt_tokens,
            max_context_tokens=self.capacity.context_window, vocab_size=self.limits.vocab_size)

    async def Prefill(self, request: handoff_pb2.PrefillRequest, context):
        log = self.log.bind(
            request_id=request_id_from(context.invocation_metadata()) or request.request_id,
            prompt_tokens=len(request.token_ids))
        rejection = validate_prefill(request, self.limits)
        fingerprint = self.limits.model_fingerprint
        if rejection is not None:
            self.refusals.add(rejection.reason_code)
            log.warning("prefill_rejected", reason=rejection.reason_code, message=rejection.message)
            self.metrics.refused(rejection.reason_code)
            yield frame_wire(header_frame(
                request.request_id, len(request.token_ids), handoff_pb2.HANDOFF_STATUS_REJECTED,
                None, fingerprint, rejection.message, rejection.reason_code, request.nonce))
            await abort_with(context, ServiceError(rejection.code, rejection.reason_code,
                                                   rejection.message))
            return
        loop = asyncio.get_running_loop()
        frames: asyncio.Queue = asyncio.Queue()
        max_chunk = request.max_chunk_bytes or DEFAULT_MAX_CHUNK_BYTES
        job = PrefillJob(
            request_id=request.request_id, token_ids=list(request.token_ids), nonce=request.nonce,
            sampling=SamplingConfig.from_proto(request.sampling, uuid.uuid4().int & (2**63 - 1)),
            chunk_tokens=self.layout.chunk_tokens(max_chunk),
            emit=lambda frame: loop.call_soon_threadsafe(frames.put_nowait, frame))
        yield frame_wire(header_frame(
            request.request_id, len(job.token_ids), handoff_pb2.HANDOFF_STATUS_OK, self.layout,
            fingerprint, nonce=job.nonce, digest=prompt_digest(job.token_ids)))
        log.info("prefill_started")
        self.engine.submit(job)
        try:
            while (frame := await frames.get()) is not None:
                yield frame
                self.engine.frame_sent(job, len(frame))
            log.info("prefill_streamed", chunks=job.chunks_sent)
        finally:
            if not job.cancelled.is_set():
                job.cancelled.set()  # no-op once the engine is done; stops work when decode left
            self.engine.stream_ended(job)  # frames never sent return their bytes


SERVICE = handoff_pb2.DESCRIPTOR.services_by_name["HandoffService"]


def add_handoff_service(servicer: HandoffServicer, server: grpc.aio.Server) -> None:
    """Registers the HandoffService: Prefill's responses are the engine's pre-serialized bytes,
    passed to gRPC unchanged; GetPrefillInfo as generated. Refuses to start if the service has
    a method this registration does not know (a new one must be added here)."""
    handlers = {
        "Prefill": grpc.unary_stream_rpc_method_handler(
            servicer.Prefill, request_deserializer=handoff_pb2.PrefillRequest.FromString,
            response_serializer=None),
        "GetPrefillInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetPrefillInfo,
            request_deserializer=handoff_pb2.GetPrefillInfoRequest.FromString,
            response_serializer=handoff_pb2.GetPrefillInfoResponse.SerializeToString),
    }
    methods = {method.name for method in SERVICE.methods}
    if methods != set(handlers):
        raise RuntimeError(f"{SERVICE.full_name} has methods {sorted(methods)}; "
                           f"add_handoff_service registers {sorted(handlers)}")
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(SERVICE.full_name, handlers)
