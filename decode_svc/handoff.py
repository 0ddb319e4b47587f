"""Receiving one handoff on decode: every frame through the verifier, every verified chunk to
the engine, and a refusal (HandoffRefused) for anything else. The caller frees the reservation
when this raises."""

from __future__ import annotations

import time

import grpc

from common.handoff.codec import bytes_to_kv
from common.handoff.reasons import HandoffRefused, refuse
from common.handoff.verifier import Expectation, HandoffVerifier
from common.pb.kvhandoff.v1 import handoff_pb2
from decode_svc.engine import DecodeEngine
from decode_svc.prefill_client import PrefillClient


async def receive_handoff(client: PrefillClient, engine: DecodeEngine,
                          request: handoff_pb2.PrefillRequest, expect: Expectation,
                          timeout: float) -> tuple[int, int]:
    """Returns (first token id, payload bytes received) once the commit is verified."""
    verifier = HandoffVerifier(expect)
    call = client.prefill(request, timeout)
    received = 0
    started = time.monotonic()
    try:
        async for frame in call:
            chunk = verifier.on_frame(frame)
            if chunk is not None:
                received += len(chunk.k) + len(chunk.v)
                kv = bytes_to_kv(expect.layout, chunk.k, chunk.v, chunk.token_end - chunk.token_start)
                engine.write(expect.request_id, chunk.layer, chunk.token_start, kv)
        return verifier.finish(), received
    except HandoffRefused:
        call.cancel()
        raise
    except grpc.aio.AioRpcError as err:
        raise _refusal_from_rpc_error(err, verifier, time.monotonic() - started) from err


def _refusal_from_rpc_error(err: grpc.aio.AioRpcError, verifier: HandoffVerifier,
                            elapsed: float) -> HandoffRefused:
    code = err.code()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return refuse("HANDOFF_TIMEOUT", f"the handoff did not complete within {elapsed:.1f}s "
                      f"({verifier.chunks_seen} chunks received)")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "message" in (err.details() or "").lower():
        return refuse("FRAME_TOO_LARGE", f"prefill sent a frame over the negotiated size: "
                      f"{err.details()}")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN):
        return refuse("PEER_UNAVAILABLE", f"prefill failed mid-handoff: "
                      f"{code.name}: {err.details()}")
    if verifier.state.value == "await_header":
        # Prefill ended the call with an error before its header: pass its status on.
        return HandoffRefused(code, "PEER_REJECTED", f"prefill refused: {err.details()}")
    return refuse("PEER_ABORTED", f"prefill ended the handoff with {code.name}: {err.details()}")
