"""The scripted fake prefill: a proxy in front of a real reference prefill of the same model.

GetPrefillInfo and ReleaseHandoff are forwarded unchanged, so the decode under test agrees to
serve (and may choose the reference's SHARED_MEMORY plane). On Prefill the fake fetches the whole
handoff from the reference for decode's own request, then plays the current script (the
reference frames unchanged, or a broken variant of them) and records what happened: the request,
the frames sent, and whether decode cancelled the call. When decode asked for SHARED_MEMORY, the
script sees the reference's KV read back from its regions, and the chunks it builds inline go
out as references into a region of the fake's own (conformance.regions), so every case plays
over that plane too; the fake removes its regions before the next call and when it stops.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from common.pb.kvhandoff.v1 import handoff_pb2, handoff_pb2_grpc
from conformance.decode_script import Abort, Script, ScriptInput, Sleep
from conformance.handoff_edit import Frame, Handoff
from conformance.regions import FakeRegions, inline_copy
from conformance.spec import ERROR_DOMAIN
from conformance.wire import read_handoff

SERVICE = "kvhandoff.v1.HandoffService"
REFERENCE_TIMEOUT = 120.0


@dataclass
class Exchange:
    """One Prefill call from the decode under test."""

    request: handoff_pb2.PrefillRequest
    sent: list[Frame | bytes] = field(default_factory=list)
    cancelled: bool = False
    reference_first_token: int | None = None  # what an honest prefill answered
    cancelled_at: float | None = None  # time.monotonic() when the cancellation arrived
    error: str = ""  # set when the fake could not play its script (e.g. the reference failed)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    ended_itself: bool = False  # the handler played its whole script, or failed the call itself


def call_ended(exchange: Exchange, context) -> None:
    """The call's done callback, run however the call ended. A call the handler did not end
    itself, before its deadline, was cancelled by decode: counted here, not on CancelledError,
    because a cancel that lands while gRPC writes a frame never reaches the handler as one (the
    generator is closed at its yield), and grpc.aio's context.cancelled() stays False."""
    remaining = context.time_remaining()
    past_deadline = remaining is not None and remaining <= 0
    if not exchange.ended_itself and not past_deadline and not exchange.cancelled:
        exchange.cancelled, exchange.cancelled_at = True, time.monotonic()
    exchange.done.set()


def passthrough(i: ScriptInput) -> list:
    return list(i.ref.original)


def error_status(step: Abort) -> grpc.Status:
    details = []
    if step.reason is not None:
        detail = any_pb2.Any()
        detail.Pack(error_details_pb2.ErrorInfo(reason=step.reason, domain=ERROR_DOMAIN))
        details.append(detail)
    return rpc_status.to_status(status_pb2.Status(
        code=step.code.value[0], message=step.message, details=details))


class FakePrefill:
    """Serve with `start(listen)`; set `script` before each decode call; read `exchanges`."""

    def __init__(self, reference: str, shm_dir: str = "/dev/shm") -> None:
        self.reference = reference
        self.regions = FakeRegions(shm_dir)  # decode's shared-memory directory, when it uses it
        self.script: Script = passthrough
        # set for cases that need the KV of another prompt of the same length: prompt -> decoy
        self.decoy: Callable[[list[int], int], list[int]] | None = None
        self.exchanges: list[Exchange] = []
        self.info: handoff_pb2.GetPrefillInfoResponse | None = None
        self._channel: grpc.aio.Channel | None = None
        self._server: grpc.aio.Server | None = None

    async def start(self, listen: str) -> int:
        self._channel = grpc.aio.insecure_channel(
            self.reference, options=[("grpc.max_receive_message_length", 256 << 20)])
        self.info = await handoff_pb2_grpc.HandoffServiceStub(self._channel).GetPrefillInfo(
            handoff_pb2.GetPrefillInfoRequest(), timeout=REFERENCE_TIMEOUT, wait_for_ready=True)
        raw = lambda m: m if isinstance(m, bytes) else m.SerializeToString()  # noqa: E731
        handlers = {
            "Prefill": grpc.unary_stream_rpc_method_handler(
                self._prefill, request_deserializer=handoff_pb2.PrefillRequest.FromString,
                response_serializer=raw),
            "GetPrefillInfo": grpc.unary_unary_rpc_method_handler(
                self._info, request_deserializer=handoff_pb2.GetPrefillInfoRequest.FromString,
                response_serializer=raw),
            "ReleaseHandoff": grpc.unary_unary_rpc_method_handler(
                self._release, request_deserializer=handoff_pb2.ReleaseHandoffRequest.FromString,
                response_serializer=raw),
        }
        self._server = grpc.aio.server(options=[("grpc.max_send_message_length", -1)])
        self._server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler(SERVICE, handlers)])
        port = self._server.add_insecure_port(listen)
        if port == 0:
            raise OSError(f"the fake prefill could not listen on {listen}")
        await self._server.start()
        return port

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(0)
        if self._channel is not None:
            await self._channel.close()
        self.regions.remove_all()

    async def _info(self, request, context):
        stub = handoff_pb2_grpc.HandoffServiceStub(self._channel)
        return await stub.GetPrefillInfo(request, timeout=REFERENCE_TIMEOUT)

    async def _release(self, request, context):
        stub = handoff_pb2_grpc.HandoffServiceStub(self._channel)
        return await stub.ReleaseHandoff(request, timeout=REFERENCE_TIMEOUT)

    def _taken_apart(self, request: handoff_pb2.PrefillRequest, frames: list) -> Handoff:
        """The reference's handoff, its bytes inline for the script; `original` stays as sent."""
        if request.data_plane != handoff_pb2.DATA_PLANE_SHARED_MEMORY:
            return Handoff.from_frames(frames)
        handoff = Handoff.from_frames(inline_copy(frames, self.regions.directory))
        handoff.original = list(frames)
        return handoff

    async def _decoy(self, request: handoff_pb2.PrefillRequest, timeout: float):
        """The reference's handoff of the decoy prompt (same length, same nonce), if wanted."""
        if self.decoy is None:
            return None
        other = handoff_pb2.PrefillRequest()
        other.CopyFrom(request)
        other.request_id = f"{request.request_id}-decoy"
        other.token_ids[:] = self.decoy(list(request.token_ids), self.info.vocab_size)
        received = await read_handoff(self._channel, other, timeout)
        return self._taken_apart(other, received.frames)

    async def _prefill(self, request: handoff_pb2.PrefillRequest, context):
        exchange = Exchange(request)
        self.exchanges.append(exchange)
        context.add_done_callback(lambda ended: call_ended(exchange, ended))
        script = self.script
        self.regions.remove_all()  # the last call's: decode is done with them
        shared_memory = request.data_plane == handoff_pb2.DATA_PLANE_SHARED_MEMORY
        try:
            remaining = context.time_remaining()  # pass decode's deadline on to the reference
            timeout = REFERENCE_TIMEOUT if remaining is None else min(remaining, REFERENCE_TIMEOUT)
            received = await read_handoff(self._channel, request, timeout)
            decoy = await self._decoy(request, timeout)
            try:
                ref = self._taken_apart(request, received.frames)
                exchange.reference_first_token = ref.commit.first_token_id
                steps = script(ScriptInput(request, ref, self.info.vocab_size, decoy,
                                           self.regions if shared_memory else None))
                if shared_memory:
                    steps = self.regions.out_of_band(steps)
            except Exception as exc:
                exchange.error = (f"could not build the scripted handoff from the reference "
                                  f"({received.kinds()[:4]}, {received.outcome.describe()}): "
                                  f"{type(exc).__name__}: {exc}")
                exchange.ended_itself = True
                await context.abort(grpc.StatusCode.UNAVAILABLE, exchange.error)
                return
            for step in steps:
                if isinstance(step, Sleep):
                    await asyncio.sleep(step.seconds)
                elif isinstance(step, Abort):
                    exchange.ended_itself = True
                    await context.abort_with_status(error_status(step))
                    return
                else:
                    exchange.sent.append(step)
                    yield step
            exchange.ended_itself = True
        except Exception:  # the reference failed, or the fake aborted the call itself
            exchange.ended_itself = True
            raise
        finally:
            exchange.done.set()
