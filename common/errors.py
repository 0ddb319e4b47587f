"""Errors that end an RPC: a gRPC code, a message a person can act on, a stable reason.

The reason travels as google.rpc.ErrorInfo (domain "kvhandoff.v1") in grpc-status-details-bin.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

ERROR_DOMAIN = "kvhandoff.v1"


@dataclass
class ServiceError(Exception):
    code: grpc.StatusCode
    reason: str
    message: str
    metadata: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.code.name} {self.reason}: {self.message}"

    def to_status(self) -> grpc.Status:
        info = error_details_pb2.ErrorInfo(
            reason=self.reason, domain=ERROR_DOMAIN, metadata=self.metadata)
        detail = any_pb2.Any()
        detail.Pack(info)
        proto = status_pb2.Status(code=self.code.value[0], message=self.message, details=[detail])
        return rpc_status.to_status(proto)


async def abort_with(context, error: ServiceError) -> None:
    """Ends a grpc.aio call with the error's code, message and ErrorInfo (raises)."""
    await context.abort_with_status(error.to_status())


def error_reason(error: grpc.RpcError) -> str | None:
    """The ErrorInfo reason in an RpcError's trailing metadata, if any."""
    metadata = error.trailing_metadata() or ()
    for key, value in metadata:
        if key == "grpc-status-details-bin":
            status = status_pb2.Status.FromString(value)
            for detail in status.details:
                if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                    info = error_details_pb2.ErrorInfo()
                    detail.Unpack(info)
                    return info.reason
    return None

