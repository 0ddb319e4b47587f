"""Decode's channel to one prefill replica: the info handshake and the handoff stream.

One channel per replica (decode_svc.prefill_replicas owns them and chooses among them per
handoff). Handoff frames arrive as raw bytes (no deserializer on the call) and are parsed by the
wire codec: a chunk in the canonical encoding costs O(header) and its payload is not copied; any
other frame goes through protobuf, in a worker thread when it is large.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from google.protobuf.message import DecodeError

from common.handoff.codec import WireChunkFrame, parse_chunk_fast
from common.handoff.reasons import HandoffRefused
from common.log import REQUEST_ID_METADATA
from common.pb.kvhandoff.v1 import handoff_pb2, handoff_pb2_grpc
from common.server.grpc_server import TlsFiles

FRAME_OVERHEAD_BYTES = 64 << 10
PREFILL_METHOD = "/kvhandoff.v1.HandoffService/Prefill"
# A frame the fast path does not take and that is at least this large is parsed off the loop.
LARGE_FRAME_BYTES = 64 << 10
# How long the call that asks why the channel never connected may take (decode_svc.server logs
# the reason: common.server.tls_diagnosis reads it).
WHY_PROBE_TIMEOUT_S = 3.0


def parse_frame(data: bytes) -> handoff_pb2.PrefillResponse:
    """The protobuf parse; a frame protobuf cannot read is refused as FRAME_MALFORMED."""
    try:
        return handoff_pb2.PrefillResponse.FromString(data)
    except DecodeError as err:
        raise HandoffRefused(grpc.StatusCode.INTERNAL, "FRAME_MALFORMED",
                             f"prefill sent a frame that is not a PrefillResponse "
                             f"({len(data)} bytes): {err}") from err


class HandoffStream:
    """One Prefill call: iterate it with `async for` (PrefillResponse or WireChunkFrame items,
    both read by the verifier), end it with `.cancel()`. gRPC errors pass through unchanged."""

    def __init__(self, call: grpc.aio.UnaryStreamCall) -> None:
        self._call = call

    def __aiter__(self) -> AsyncIterator[handoff_pb2.PrefillResponse | WireChunkFrame]:
        return self._frames()

    async def _frames(self) -> AsyncIterator[handoff_pb2.PrefillResponse | WireChunkFrame]:
        async for data in self._call:
            frame = parse_chunk_fast(data)
            if frame is not None:
                yield frame
            elif len(data) >= LARGE_FRAME_BYTES:
                yield await asyncio.to_thread(parse_frame, data)
            else:
                yield parse_frame(data)

    def cancel(self) -> bool:
        return self._call.cancel()

    def add_done_callback(self, callback) -> None:
        """callback(call) once the call is done, however it ended (gRPC's own hook)."""
        self._call.add_done_callback(callback)


class PrefillClient:
    """One replica's channel. tls_name: the name its certificate must carry when target is an
    address that DNS gave for that name."""

    def __init__(self, target: str, max_chunk_bytes: int, tls: TlsFiles | None,
                 tls_name: str | None = None) -> None:
        options = [
            ("grpc.max_receive_message_length", max_chunk_bytes + FRAME_OVERHEAD_BYTES),
            ("grpc.enable_retries", 0),
            ("grpc.initial_reconnect_backoff_ms", 500),
            ("grpc.max_reconnect_backoff_ms", 5000),
            ("grpc.http2.max_frame_size", (1 << 24) - 1),
        ]
        if tls and tls_name:
            options.append(("grpc.ssl_target_name_override", tls_name))
        self.target = target
        self.tls_name = tls_name
        self.channel = (grpc.aio.secure_channel(target, tls.channel_credentials(), options)
                        if tls else grpc.aio.insecure_channel(target, options))
        self.stub = handoff_pb2_grpc.HandoffServiceStub(self.channel)
        self._prefill_raw = self.channel.unary_stream(
            PREFILL_METHOD, request_serializer=handoff_pb2.PrefillRequest.SerializeToString,
            response_deserializer=None, _registered_method=True)

    async def info(self, timeout: float, wait_for_ready: bool = True
                   ) -> handoff_pb2.GetPrefillInfoResponse:
        """GetPrefillInfo. A wait_for_ready call that times out says only DEADLINE_EXCEEDED,
        whatever kept the channel from connecting (a TLS handshake that fails every time
        included): one more call that does not wait then fails with the channel's last error
        in its details (UNAVAILABLE: '... Tls handshake failed ...'), which is raised instead
        (or answers, if prefill has just come up)."""
        request = handoff_pb2.GetPrefillInfoRequest()
        try:
            return await self.stub.GetPrefillInfo(request, timeout=timeout,
                                                  wait_for_ready=wait_for_ready)
        except grpc.aio.AioRpcError as err:
            if not wait_for_ready or err.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
            try:
                return await self.stub.GetPrefillInfo(request, timeout=WHY_PROBE_TIMEOUT_S,
                                                      wait_for_ready=False)
            except grpc.aio.AioRpcError as why:
                if why.code() != grpc.StatusCode.UNAVAILABLE:
                    raise err from None
                raise why from None

    def prefill(self, request: handoff_pb2.PrefillRequest, timeout: float) -> HandoffStream:
        """A streaming call; iterate it with `async for`, cancel it with `.cancel()`."""
        return HandoffStream(self._prefill_raw(
            request, timeout=timeout, metadata=((REQUEST_ID_METADATA, request.request_id),)))

    async def release(self, request_id: str, nonce: bytes, timeout: float) -> bool:
        """ReleaseHandoff: prefill may free the bytes an out-of-band handoff refers to."""
        response = await self.stub.ReleaseHandoff(
            handoff_pb2.ReleaseHandoffRequest(request_id=request_id, nonce=nonce),
            timeout=timeout)
        return response.released

    async def close(self) -> None:
        await self.channel.close()
