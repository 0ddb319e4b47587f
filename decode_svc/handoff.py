"""Receiving one handoff on decode: every frame through the verifier, every verified chunk to
the engine, and a refusal (HandoffRefused) for anything else. The caller frees the reservation
when this raises; this function ends (cancels) the prefill call however it returns.

The handoff gets the caller's budget less a margin (SPEC.md D-22), so that when prefill stalls
decode's own DEADLINE_EXCEEDED/HANDOFF_TIMEOUT reaches the client before the client's deadline
does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc

from common.errors import error_reason
from common.handoff.codec import bytes_to_kv
from common.handoff.reasons import HandoffRefused, refuse
from common.handoff.verifier import Expectation, HandoffState, HandoffVerifier
from common.pb.kvhandoff.v1 import handoff_pb2
from decode_svc.content_check import ContentCheckConfig
from decode_svc.engine import DecodeEngine
from decode_svc.prefill_client import PrefillClient

DEADLINE_MARGIN_FRACTION = 0.1
DEADLINE_MARGIN_MAX_S = 1.0


@dataclass(frozen=True)
class HandoffPolicy:
    """What decode accepts beyond the form rules: 1.0 (unbound) handoffs only when the operator
    allowed them; the content checks (off only for benchmarks that measure their cost)."""

    allow_protocol_1_0: bool = False
    content: ContentCheckConfig = field(default_factory=ContentCheckConfig)


@dataclass(frozen=True)
class ReceivedHandoff:
    """A handoff whose form is verified and whose writes are queued on the engine."""

    advisory_first_token: int  # prefill's first_token_id: logged, never streamed when checked
    payload_bytes: int
    bound: bool  # protocol 1.1 binding checked (False: a 1.0 prefill the operator allowed)


def handoff_budget(timeout: float) -> float:
    """The prefill call's deadline: the caller's budget less 10% (at most 1 s)."""
    return timeout - min(DEADLINE_MARGIN_MAX_S, DEADLINE_MARGIN_FRACTION * timeout)


async def receive_handoff(client: PrefillClient, engine: DecodeEngine,
                          request: handoff_pb2.PrefillRequest, expect: Expectation,
                          timeout: float) -> ReceivedHandoff:
    """Returns once the stream ended in a verified commit; raises HandoffRefused otherwise."""
    verifier = HandoffVerifier(expect)
    call = client.prefill(request, handoff_budget(timeout))
    received = 0
    started = time.monotonic()
    try:
        async for frame in call:
            chunk = verifier.on_frame(frame)
            if chunk is not None:
                received += len(chunk.k) + len(chunk.v)
                count = chunk.token_end - chunk.token_start
                kv = bytes_to_kv(expect.layout, chunk.k, chunk.v, count)
                engine.write(expect.request_id, chunk.layer, chunk.token_start, kv)
        return ReceivedHandoff(verifier.finish(), received, verifier.bound)
    except grpc.aio.AioRpcError as err:
        raise _refusal_from_rpc_error(err, verifier, time.monotonic() - started) from err
    finally:
        call.cancel()  # a no-op once the call is done; stops prefill's work otherwise


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
