"""Talking kvhandoff.v1 at the frame level: reading a whole handoff stream (malformed frames
included) and reading the google.rpc.ErrorInfo of a gRPC error."""

from __future__ import annotations

from dataclasses import dataclass, field

import google_crc32c
import grpc
from google.rpc import error_details_pb2, status_pb2

from common.pb.kvhandoff.v1 import handoff_pb2

PREFILL_METHOD = "/kvhandoff.v1.HandoffService/Prefill"


def crc32c(k: bytes, v: bytes) -> int:
    """CRC-32C (Castagnoli) of k followed by v, as a chunk carries it."""
    return google_crc32c.extend(google_crc32c.value(k), v)


@dataclass(frozen=True)
class RpcOutcome:
    """How a call ended: code OK, or an error with its ErrorInfo (reason, domain) if any."""

    code: grpc.StatusCode
    details: str = ""
    reason: str | None = None
    domain: str | None = None

    def describe(self) -> str:
        if self.code == grpc.StatusCode.OK:
            return "OK"
        info = f" reason={self.reason}" if self.reason is not None else " (no ErrorInfo)"
        return f"{self.code.name}{info}: {self.details}"


def outcome_of(err: grpc.RpcError) -> RpcOutcome:
    reason = domain = None
    for key, value in err.trailing_metadata() or ():
        if key != "grpc-status-details-bin":
            continue
        for detail in status_pb2.Status.FromString(value).details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                reason, domain = info.reason, info.domain
    return RpcOutcome(err.code(), err.details() or "", reason, domain)


@dataclass
class Received:
    """Every frame of one Prefill stream, in order (None for a frame that did not parse)."""

    frames: list[handoff_pb2.PrefillResponse | None] = field(default_factory=list)
    outcome: RpcOutcome = RpcOutcome(grpc.StatusCode.OK)

    def kinds(self) -> list[str]:
        return ["malformed" if f is None else (f.WhichOneof("frame") or "empty")
                for f in self.frames]

    @property
    def chunks(self) -> list[handoff_pb2.KvChunk]:
        return [f.chunk for f in self.frames if f is not None and f.HasField("chunk")]


def request_serializer(extra: bytes = b""):
    """Serializes a PrefillRequest, appending raw bytes (e.g. an unknown field) when given."""
    return lambda message: message.SerializeToString() + extra


async def read_handoff(channel: grpc.aio.Channel, request: handoff_pb2.PrefillRequest,
                       timeout: float, extra: bytes = b"", stop_after: int | None = None
                       ) -> Received:
    """Reads the stream to its end (or cancels it after `stop_after` frames)."""
    call = channel.unary_stream(PREFILL_METHOD, request_serializer=request_serializer(extra),
                                response_deserializer=handoff_pb2.PrefillResponse.FromString)(
        request, timeout=timeout)
    received = Received()
    try:
        async for frame in call:
            received.frames.append(frame)
            if stop_after is not None and len(received.frames) >= stop_after:
                call.cancel()
                received.outcome = RpcOutcome(grpc.StatusCode.CANCELLED, "cancelled by the suite")
                return received
    except grpc.aio.AioRpcError as err:
        received.outcome = outcome_of(err)
    return received


def unknown_field(number: int = 999, value: int = 1) -> bytes:
    """A varint field with a number no kvhandoff.v1 message uses, as raw wire bytes."""
    def varint(n: int) -> bytes:
        out = bytearray()
        while True:
            byte, n = n & 0x7F, n >> 7
            out.append(byte | (0x80 if n else 0))
            if not n:
                return bytes(out)

    return varint(number << 3) + varint(value)
