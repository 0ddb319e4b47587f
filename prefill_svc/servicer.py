"""The HandoffService on prefill: validates, then relays the engine's frames to decode.

Frames travel as bytes already serialized by the engine thread (`common.handoff.codec`), so the
event loop never serializes a payload: `add_handoff_service` registers Prefill with no response
serializer (gRPC sends the bytes as they are) and every other method as generated. Log lines of
a request carry the `x-request-id` decode sent (else the PrefillRequest's id), so they join
decode's lines of the same request.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

import grpc

from common.capacity import Capacity
from common.counters import Counters
from common.errors import ServiceError, abort_with
from common.handoff.binding import prompt_digest
from common.handoff.codec import frame_wire, header_frame
from common.handoff.layout import (DEFAULT_MAX_CHUNK_BYTES, PROTOCOL_MINOR_CACHED, KvLayout,
                                   protocol_version)
from common.handoff.planes import NIXL, SHARED_MEMORY, TO_PROTO
from common.log import request_id_from
from common.metrics import NullMetrics
from common.pb.kvhandoff.v1 import handoff_pb2, handoff_pb2_grpc
from common.sampling import SamplingConfig
from prefill_svc.cached_commit import with_cached_tokens
from prefill_svc.engine import PrefillEngine, PrefillJob
from prefill_svc.handoff_leases import DEFAULT_GRACE_S, HandoffLeases
from prefill_svc.kv_sender import InlineSender, KvSender
from prefill_svc.nixl_pages_sender import NixlPagesSender
from prefill_svc.nixl_sender import NixlPlane, NixlSender
from prefill_svc.page_lease import LeaseBudget, PageLeaseConfig
from prefill_svc.shm_sender import SharedMemorySender
from prefill_svc.validation import PrefillLimits, validate_prefill


@dataclass(frozen=True)
class PlaneOffer:
    """The out-of-band planes this prefill serves beside inline: shm_host_id is '' when it does
    not offer shared memory, else its host identity (common.handoff.planes.host_identity)."""

    shm_host_id: str = ""
    shm_dir: str = ""
    release_grace_s: float = DEFAULT_GRACE_S
    nixl: NixlPlane | None = None  # None: NIXL not offered (no wheel, no backend, or TLS)
    # NIXL handoffs of a CPU pool served from the pages themselves, bounded (P-68)
    page_lease: PageLeaseConfig = field(default_factory=PageLeaseConfig)

    def offers(self) -> list[handoff_pb2.DataPlaneOffer]:
        """Fastest first (common.handoff.planes.PREFERENCE); inline always."""
        out = []
        if self.shm_host_id:
            out.append(handoff_pb2.DataPlaneOffer(plane=TO_PROTO[SHARED_MEMORY],
                                                  host_id=self.shm_host_id))
        if self.nixl is not None:
            out.append(handoff_pb2.DataPlaneOffer(plane=TO_PROTO[NIXL],
                                                  nixl_agent_metadata=self.nixl.metadata))
        return out + [handoff_pb2.DataPlaneOffer(plane=handoff_pb2.DATA_PLANE_INLINE)]

    def served(self) -> frozenset[int]:
        return frozenset({handoff_pb2.DATA_PLANE_UNSPECIFIED} | {o.plane for o in self.offers()})


class HandoffServicer(handoff_pb2_grpc.HandoffServiceServicer):
    def __init__(self, engine: PrefillEngine, layout: KvLayout, capacity: Capacity,
                 limits: PrefillLimits, refusals: Counters, log, metrics=None,
                 planes: PlaneOffer | None = None) -> None:
        self.planes = planes or PlaneOffer()
        self.leases = HandoffLeases(self.planes.release_grace_s, engine.counters)
        self.engine = engine
        self.layout = layout
        self.capacity = capacity
        self.limits = limits
        self.refusals = refusals
        self.log = log
        self.metrics = metrics if metrics is not None else NullMetrics()
        self.lease_budget = LeaseBudget(self.planes.page_lease, engine.pool.allocator.num_pages,
                                        engine.counters)
        self.nixl_from_pages = self._nixl_source()

    def _nixl_source(self) -> bool:
        """The rule, logged once: NIXL handoffs come straight from the pool's pages when the
        pool is in host memory and the page lease is on (each handoff within its cap: P-68),
        else from a packed buffer per handoff (P-66)."""
        if self.planes.nixl is None:
            return False
        pool = self.engine.pool
        why = ("" if pool.k.device.type == "cpu" else
               f"the KV pool is on {pool.k.device.type}, not registrable as host pages")
        if not self.planes.page_lease.enabled:
            why = "the page lease is off"
        if why:
            self.log.info("nixl_source", path="packed",
                          message=f"NIXL handoffs are packed into a registered buffer: {why}")
        else:
            self.log.info("nixl_source", path="pages", max_pages=self.lease_budget.max_pages,
                          max_handoffs=self.planes.page_lease.max_handoffs,
                          message="NIXL handoffs are read straight from the KV pages, held "
                          "until decode releases them; past the cap, packed")
        return not why

    def _nixl_sender(self, request: handoff_pb2.PrefillRequest) -> KvSender:
        tokens = len(request.token_ids)
        pages = self.engine.pool.allocator.pages_needed(tokens)
        if self.nixl_from_pages:
            if self.lease_budget.take(pages):
                return NixlPagesSender(request.request_id, self.layout, tokens, self.planes.nixl,
                                       self.engine.pool, self.lease_budget,
                                       self.engine.return_pages, self.engine.counters,
                                       request.max_chunk_bytes or DEFAULT_MAX_CHUNK_BYTES)
            self.log.info("nixl_page_lease_full", request_id=request.request_id,
                          message=f"packed: {self.lease_budget.why_not(pages)}")
        return NixlSender(request.request_id, self.layout, tokens, self.planes.nixl)

    async def GetPrefillInfo(self, request, context) -> handoff_pb2.GetPrefillInfoResponse:
        return handoff_pb2.GetPrefillInfoResponse(
            model_fingerprint=self.limits.model_fingerprint, layout=self.layout.to_proto(),
            page_size=self.capacity.page_size, protocol_versions=[protocol_version()],
            max_prompt_tokens=self.capacity.max_prompt_tokens,
            max_context_tokens=self.capacity.context_window, vocab_size=self.limits.vocab_size,
            data_planes=self.planes.offers())

    async def ReleaseHandoff(self, request: handoff_pb2.ReleaseHandoffRequest, context
                             ) -> handoff_pb2.ReleaseHandoffResponse:
        return handoff_pb2.ReleaseHandoffResponse(
            released=self.leases.release(request.request_id, request.nonce))

    def _sender(self, request: handoff_pb2.PrefillRequest) -> KvSender:
        if request.data_plane == TO_PROTO[SHARED_MEMORY]:
            sender = SharedMemorySender(request.request_id, self.layout, len(request.token_ids),
                                        self.planes.shm_dir, self.leases.regions)
            self.leases.add(request.request_id, request.nonce, sender)
            return sender
        if request.data_plane == TO_PROTO[NIXL] and self.planes.nixl is not None:
            sender = self._nixl_sender(request)
            self.leases.add(request.request_id, request.nonce, sender)
            return sender
        return InlineSender(request.request_id)

    async def Prefill(self, request: handoff_pb2.PrefillRequest, context):
        received = time.monotonic()
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
            emit=lambda frame: loop.call_soon_threadsafe(frames.put_nowait, frame),
            sender=self._sender(request), cache_scope=request.cache_scope)
        completed = False
        reports_cached = request.protocol_version.minor >= PROTOCOL_MINOR_CACHED  # 1.2, P-90
        try:
            yield frame_wire(header_frame(
                request.request_id, len(job.token_ids), handoff_pb2.HANDOFF_STATUS_OK,
                self.layout, fingerprint, nonce=job.nonce, digest=prompt_digest(job.token_ids)))
            log.info("prefill_started")
            self.engine.submit(job)
            while (frame := await frames.get()) is not None:
                yield with_cached_tokens(frame, job.cached_tokens) if reports_cached else frame
                self.engine.frame_sent(job, len(frame))  # the bytes the engine emitted
            completed = True
            log.info("prefill_streamed", chunks=job.chunks_sent, plane=job.sender.plane,
                     cached_tokens=job.cached_tokens,
                     marks_ago_ms=marks_ago_ms({"received": received, **job.marks}))
        finally:
            if not job.cancelled.is_set():
                job.cancelled.set()  # no-op once the engine is done; stops work when decode left
            self.engine.stream_ended(job)  # frames never sent return their bytes
            if not job.sender.pins_bytes:
                job.sender.release(completed)  # nothing outlives an inline stream
            else:  # decode may still be copying: it releases, or the grace period does (P-62)
                self.leases.stream_ended(request.request_id, request.nonce, completed)


def marks_ago_ms(marks: dict[str, float]) -> dict[str, float]:
    """{milestone: ms from it to now}, earliest first: a log line's own timestamp places them
    on the wall clock (bench/ttft_trace.py), the intervals themselves are monotonic."""
    now = time.monotonic()
    return {name: round((now - at) * 1e3, 3)
            for name, at in sorted(marks.items(), key=lambda item: item[1])}


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
        "ReleaseHandoff": grpc.unary_unary_rpc_method_handler(
            servicer.ReleaseHandoff,
            request_deserializer=handoff_pb2.ReleaseHandoffRequest.FromString,
            response_serializer=handoff_pb2.ReleaseHandoffResponse.SerializeToString),
    }
    methods = {method.name for method in SERVICE.methods}
    if methods != set(handlers):
        raise RuntimeError(f"{SERVICE.full_name} has methods {sorted(methods)}; "
                           f"add_handoff_service registers {sorted(handlers)}")
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(SERVICE.full_name, handlers)
