"""Waiting until a gRPC server reports SERVING on the standard health service: the one wait that
the `kvhandoff` command, the benchmarks, the conformance suite and the tests use.

A server built by `common.server.grpc_server.create_server` answers health from the moment it
listens (NOT_SERVING while it warms up or while decode has not agreed with prefill), so a wait
can start as soon as the port is known.
"""

from __future__ import annotations

import subprocess
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

POLL_SECONDS = 0.1
CHECK_TIMEOUT_SECONDS = 2.0
SERVING = health_pb2.HealthCheckResponse.SERVING
# a server that starts after the wait began is seen within a second (grpc's default backoff
# grows to two minutes)
CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200),
                   ("grpc.max_reconnect_backoff_ms", 1000)]


class ServerExited(RuntimeError):
    """The server's process ended before it reported SERVING."""


def wait_serving(address: str, timeout: float, *,
                 credentials: grpc.ChannelCredentials | None = None,
                 proc: subprocess.Popen | None = None, service: str = "") -> None:
    """Polls grpc.health.v1 Check(service) on address until it answers SERVING.

    credentials: a TLS server's channel credentials (None: plaintext). proc: the server's
    process, if this caller started it; its exit raises ServerExited at once. After timeout
    seconds raises TimeoutError naming the last answer seen."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    channel = (grpc.secure_channel(address, credentials, CHANNEL_OPTIONS)
               if credentials is not None else grpc.insecure_channel(address, CHANNEL_OPTIONS))
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if proc is not None and proc.poll() is not None:
                raise ServerExited(f"process exited with {proc.returncode} before serving")
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(service=service),
                                    timeout=CHECK_TIMEOUT_SECONDS).status
                if status == SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
            except grpc.RpcError as err:
                last = err.code().name
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{address} not SERVING after {timeout:g}s (last: {last})")
            time.sleep(POLL_SECONDS)
