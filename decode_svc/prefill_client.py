"""Decode's channel to prefill: the info handshake and the handoff stream.

One channel for all prefill replicas: a DNS name with several addresses is balanced by gRPC's
own round_robin policy.
"""

from __future__ import annotations

import grpc

from common.server.grpc_server import TlsFiles
from common.pb.kvhandoff.v1 import handoff_pb2, handoff_pb2_grpc

FRAME_OVERHEAD_BYTES = 64 << 10


class PrefillClient:
    def __init__(self, target: str, max_chunk_bytes: int, tls: TlsFiles | None) -> None:
        options = [
            ("grpc.max_receive_message_length", max_chunk_bytes + FRAME_OVERHEAD_BYTES),
            ("grpc.lb_policy_name", "round_robin"),
            ("grpc.enable_retries", 0),
        ]
        self.target = target
        self.channel = (grpc.aio.secure_channel(target, tls.channel_credentials(), options)
                        if tls else grpc.aio.insecure_channel(target, options))
        self.stub = handoff_pb2_grpc.HandoffServiceStub(self.channel)

    async def info(self, timeout: float) -> handoff_pb2.GetPrefillInfoResponse:
        return await self.stub.GetPrefillInfo(handoff_pb2.GetPrefillInfoRequest(),
                                              timeout=timeout, wait_for_ready=True)

    def prefill(self, request: handoff_pb2.PrefillRequest, timeout: float):
        """A streaming call; iterate it with `async for`, cancel it with `.cancel()`."""
        return self.stub.Prefill(request, timeout=timeout,
                                 metadata=(("x-request-id", request.request_id),))

    async def close(self) -> None:
        await self.channel.close()
