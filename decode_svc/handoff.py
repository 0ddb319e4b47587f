"""Receiving one handoff on decode: every frame through the verifier, every verified chunk to
the engine, and a refusal (HandoffRefused) for anything else. The caller frees the reservation
when this raises; this function ends (cancels) the prefill call however it returns.

The handoff gets the caller's budget less a margin (SPEC.md D-22), so that when prefill stalls
decode's own DEADLINE_EXCEEDED/HANDOFF_TIMEOUT reaches the client before the client's deadline
does.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import numpy as np

from common.errors import error_reason
from common.handoff.reasons import HandoffRefused, refuse
from common.handoff.transfer import TransferRecord, TransferState
from common.handoff.verifier import (Expectation, HandoffState, HandoffVerifier,
                                     VerifiedChunk)
from common.pb.kvhandoff.v1 import handoff_pb2
from decode_svc.content_check import ContentCheckConfig
from decode_svc.engine import DecodeEngine
from decode_svc.inline_landing import InlineLanding
from decode_svc.kv_receiver import HandoffJob, KvReceiver, LandedKv
from decode_svc.page_landing import PageLanding
from decode_svc.prefill_client import PrefillClient
from decode_svc.prefill_replicas import PrefillReplicas

# A hook that turns a received frame into the frame the verifier reads: the out-of-band planes
# replace a chunk's reference by decode's own copy of the bytes it names (or refuse it). It may
# return an awaitable (NIXL waits for its READ).
Resolve = Callable[[object], object]
# What happens to a verified chunk: by default its bytes go to the engine's write path; a plane
# that read them straight into the request's pages only tells the engine they are there.
Deliver = Callable[[VerifiedChunk], None]

DEADLINE_MARGIN_FRACTION = 0.1
DEADLINE_MARGIN_MAX_S = 1.0


@dataclass(frozen=True)
class HandoffPolicy:
    """What decode accepts beyond the form rules: 1.0 (unbound) handoffs only when the operator
    allowed them; the content checks (off only for benchmarks that measure their cost)."""

    allow_protocol_1_0: bool = False
    content: ContentCheckConfig = field(default_factory=ContentCheckConfig)


ReceivedHandoff = LandedKv  # the name before the seam; prefill's first token is advisory


def handoff_budget(timeout: float) -> float:
    """The prefill call's deadline: the caller's budget less 10% (at most 1 s)."""
    return timeout - min(DEADLINE_MARGIN_MAX_S, DEADLINE_MARGIN_FRACTION * timeout)


async def receive_handoff(client: PrefillClient | PrefillReplicas, engine: DecodeEngine,
                          request: handoff_pb2.PrefillRequest, expect: Expectation,
                          timeout: float, record: TransferRecord | None = None,
                          resolve: Resolve | None = None, deliver: Deliver | None = None
                          ) -> LandedKv:
    """Returns once the stream ended in a verified commit; raises HandoffRefused otherwise.
    resolve (out-of-band planes) runs on each frame before the verifier sees it; deliver, on
    each verified chunk instead of the engine's write."""
    record = record or TransferRecord(request.request_id, "inline")
    verifier = HandoffVerifier(expect)
    call = None
    received = 0
    started = time.monotonic()
    try:
        call = client.prefill(request, handoff_budget(timeout))  # may refuse: no replica
        record.mark("call_opened")
        async for frame in call:
            record.mark("first_frame")  # the header, sent before prefill's pass starts
            if resolve is not None:
                frame = resolve(frame)
                if inspect.isawaitable(frame):  # NIXL: the READ of the chunk's bytes
                    frame = await frame
            else:
                frame = _inline_only(frame)
            chunk = verifier.on_frame(frame)
            if chunk is not None:
                record.mark("first_chunk")
                record.move(TransferState.TRANSFERRING)
                received += len(chunk.k) + len(chunk.v)
                if deliver is not None:
                    deliver(chunk)
                else:
                    write_chunk(engine, expect.request_id, chunk)
                if record.on_chunk is not None:
                    record.on_chunk(chunk)
                record.bytes_landed = received
                record.marks["last_chunk"] = time.monotonic()
        record.mark("stream_ended")  # the commit read and the call's status with it
        landed = LandedKv(verifier.finish(), received, verifier.bound,
                          cached_tokens=verifier.cached_tokens)
        record.move(TransferState.SUCCESS)
        return landed
    except grpc.aio.AioRpcError as err:
        refusal = _refusal_from_rpc_error(err, verifier, time.monotonic() - started)
        record.move(TransferState.FAILED, refusal.reason)
        raise refusal from err
    except BaseException as err:
        record.move(TransferState.FAILED, getattr(err, "reason", type(err).__name__))
        raise
    finally:
        if call is not None:
            call.cancel()  # a no-op once the call is done; stops prefill's work otherwise


def write_chunk(engine: DecodeEngine, request_id: str, chunk: VerifiedChunk) -> None:
    """The verified bytes go to the engine as they are: decode's own copy (the received frame,
    or what a plane read out of its region), no tensor between."""
    engine.write_bytes(request_id, chunk.layer, chunk.token_start,
                       chunk.token_end - chunk.token_start,
                       np.frombuffer(chunk.k, dtype=np.uint8),
                       np.frombuffer(chunk.v, dtype=np.uint8))


def _inline_only(frame):
    """On the inline plane a chunk carries its bytes, never a reference (D-63): a reference
    there names memory decode did not ask for, so the handoff is refused, nothing read. (The
    wire codec's fast path only takes chunks without one; they reach here as protobuf.)"""
    if (isinstance(frame, handoff_pb2.PrefillResponse) and frame.WhichOneof("frame") == "chunk"
            and frame.chunk.HasField("ref")):
        raise refuse("REFERENCE_UNEXPECTED", f"chunk {frame.chunk.sequence_number} carries a "
                     "shared-memory reference on an inline handoff")
    return frame


class InlineReceiver(KvReceiver):
    """The portable plane every peer speaks: K and V bytes inside the gRPC chunk frames. With a
    CPU pool each chunk lands in the pages with its checks in one pass (decode_svc.
    inline_landing) unless in_place is False (the engine's write path, kept for the bench)."""

    plane = "inline"

    def __init__(self, client: PrefillClient, engine: DecodeEngine, in_place: bool = True
                 ) -> None:
        self.client = client
        self.engine = engine
        self.pages = PageLanding(engine.pool)
        self.in_place = in_place and self.pages.in_place

    async def receive(self, job: HandoffJob, record: TransferRecord) -> LandedKv:
        if not self.in_place:
            return await receive_handoff(self.client, self.engine, job.request, job.expect,
                                         job.timeout_s, record)
        landing = InlineLanding(job.expect, self.engine, self.pages, _inline_only, write_chunk)
        return await receive_handoff(self.client, self.engine, job.request, job.expect,
                                     job.timeout_s, record, landing.resolve, landing.deliver)


def _refusal_from_rpc_error(err: grpc.aio.AioRpcError, verifier: HandoffVerifier,
                            elapsed: float) -> HandoffRefused:
    code = err.code()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return refuse("HANDOFF_TIMEOUT", f"the handoff did not complete within {elapsed:.1f}s "
                      f"({verifier.chunks_seen} chunks received)")
    if (code == grpc.StatusCode.RESOURCE_EXHAUSTED and error_reason(err) is None
            and "larger than max" in (err.details() or "")):
        # grpc's own receive limit (max_chunk_bytes plus framing): the peer sent a frame over it
        return refuse("FRAME_TOO_LARGE", f"prefill sent a frame over the negotiated size: "
                      f"{err.details()}")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN):
        return refuse("PEER_UNAVAILABLE", f"prefill failed mid-handoff: "
                      f"{code.name}: {err.details()}")
    if verifier.state == HandoffState.AWAIT_HEADER:
        # Prefill ended the call with an error before its header: pass its status on.
        return HandoffRefused(code, "PEER_REJECTED", f"prefill refused: {err.details()}")
    return refuse("PEER_ABORTED", f"prefill ended the handoff with {code.name}: {err.details()}")
