"""A grpc.aio server with the standard companions (health, reflection) and graceful shutdown.

Shape after grpc/grpc examples/python: `create_server(...) -> (server, port, health)` builds and
starts; `serve_until_signalled` waits for SIGTERM/SIGINT, reports NOT_SERVING, then drains.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection


@dataclass(frozen=True)
class TlsFiles:
    """PEM paths. With ca set on a server, clients must present a certificate signed by it."""

    cert: str
    key: str
    ca: str = ""

    def server_credentials(self) -> grpc.ServerCredentials:
        root = Path(self.ca).read_bytes() if self.ca else None
        return grpc.ssl_server_credentials(
            [(Path(self.key).read_bytes(), Path(self.cert).read_bytes())],
            root_certificates=root, require_client_auth=bool(root))

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=Path(self.ca).read_bytes() if self.ca else None,
            private_key=Path(self.key).read_bytes() if self.key else None,
            certificate_chain=Path(self.cert).read_bytes() if self.cert else None)


def message_size_options(max_bytes: int) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", max_bytes),
            ("grpc.max_receive_message_length", max_bytes)]


async def create_server(
    register: Callable[[grpc.aio.Server], list[str]], host: str, port: int,
    tls: TlsFiles | None, max_message_bytes: int,
    interceptors: list | None = None,
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """register adds the servicers and returns their full service names. Health starts at
    NOT_SERVING; the caller flips it once the model is warm."""
    server = grpc.aio.server(options=message_size_options(max_message_bytes),
                             interceptors=interceptors or ())
    names = register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ["", *names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection(
        [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME], server)
    address = f"{host}:{port}"
    bound = (server.add_secure_port(address, tls.server_credentials()) if tls
             else server.add_insecure_port(address))
    if bound == 0:
        raise OSError(f"could not bind {address}")
    await server.start()
    return server, bound, health_servicer


async def set_serving(health_servicer, names: list[str], serving: bool) -> None:
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in ["", *names]:
        await health_servicer.set(name, status)


async def serve_until_signalled(server: grpc.aio.Server, health_servicer, names: list[str],
                                grace: float, on_stop: Callable[[], Awaitable[None]] | None = None
                                ) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server_done = asyncio.ensure_future(server.wait_for_termination())
    stop_wait = asyncio.ensure_future(stop.wait())
    await asyncio.wait([server_done, stop_wait], return_when=asyncio.FIRST_COMPLETED)
    await set_serving(health_servicer, names, False)
    await server.stop(grace)
    if on_stop is not None:
        await on_stop()
    for task in (server_done, stop_wait):
        task.cancel()


def run_async(main: Callable[[], Awaitable[None]]) -> None:
    """Runs main on uvloop when it is installed."""
    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())
