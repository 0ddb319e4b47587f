"""A grpc.aio server with the standard companions (health, reflection) and graceful shutdown.

Shape after grpc/grpc examples/python: `create_server(...) -> (server, port, health)` builds and
starts; `serve_until_signalled` waits for SIGTERM/SIGINT, then drains: health NOT_SERVING (and
still answering), new work refused with UNAVAILABLE, in-flight work finished within the grace
time, then the server stopped.
"""

from __future__ import annotations

import asyncio
import inspect
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.errors import ServiceError
from common.server.ports import check_port_free, port_error
from common.server.reflection import enable_reflection

# After a drain with no work left: how long the server lets replies already written flush.
STOP_FLUSH_S = 0.5
# Methods that stay open while draining and do not count as in-flight work: health,
# reflection and the read-only stats (so a drain can be watched).
LIFECYCLE_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.",
                      "/kvhandoff.v1.StatsService/")

T = TypeVar("T")


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


class ServingState(health.aio.HealthServicer):
    """The grpc.health.v1 servicer, plus the server's lifecycle: how many work RPCs are in
    flight and whether a drain has begun.

    Invariants: once draining, every status is NOT_SERVING for good (later sets are ignored,
    so a late warm-up or handshake cannot report SERVING) and every new work RPC is refused;
    in_flight counts work RPCs (not health, reflection or stats) from start to end, and _calls
    holds their tasks; all of it is touched on the server's event loop only. A drain whose
    grace ran out ends the calls still running with `shutdown_status`, not gRPC's bare
    "Cancelling all calls"."""

    def __init__(self) -> None:
        super().__init__()
        self.draining = False
        self.in_flight = 0
        self.cut_reason = ""  # set when a drain ends the calls still running: why
        self._calls: set[asyncio.Task] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    async def begin_drain(self) -> None:
        self.draining = True
        await self.enter_graceful_shutdown()

    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()
        if (task := asyncio.current_task()) is not None:
            self._calls.add(task)

    def leave(self) -> None:
        self.in_flight -= 1
        self._calls.discard(asyncio.current_task())
        if self.in_flight == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()

    async def end_calls(self, reason: str, settle: float = 2.0) -> None:
        """Cancels every work call still running; each answers UNAVAILABLE (DRAINING) with a
        message naming reason, and frees what it held as any cancelled call does. Waits up
        to settle seconds for them to end."""
        self.cut_reason = reason
        for task in list(self._calls):
            task.cancel()
        try:
            await asyncio.wait_for(self.wait_idle(), settle)
        except TimeoutError:
            pass


def draining_status() -> grpc.Status:
    """UNAVAILABLE with ErrorInfo reason DRAINING: retryable, on another replica."""
    return ServiceError(grpc.StatusCode.UNAVAILABLE, "DRAINING",
                        "the server is shutting down and takes no new requests; retry on "
                        "another replica").to_status()


def shutdown_status(reason: str) -> grpc.Status:
    """UNAVAILABLE (DRAINING) for a call that a shutdown ended before it finished."""
    return ServiceError(grpc.StatusCode.UNAVAILABLE, "DRAINING",
                        f"the server shut down before this request finished ({reason}); "
                        f"retry on another replica").to_status()


class DrainInterceptor(grpc.aio.ServerInterceptor):
    """Counts work RPCs in the ServingState and refuses new ones once it drains."""

    def __init__(self, state: ServingState) -> None:
        self.state = state

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(LIFECYCLE_PREFIXES):
            return handler
        kinds = {(False, False): grpc.unary_unary_rpc_method_handler,
                 (False, True): grpc.unary_stream_rpc_method_handler,
                 (True, False): grpc.stream_unary_rpc_method_handler,
                 (True, True): grpc.stream_stream_rpc_method_handler}
        streaming = (handler.request_streaming, handler.response_streaming)
        behavior = (handler.unary_unary or handler.unary_stream or handler.stream_unary
                    or handler.stream_stream)
        return kinds[streaming](self._track(behavior), handler.request_deserializer,
                                handler.response_serializer)

    def _track(self, behavior):
        state = self.state
        if inspect.isasyncgenfunction(behavior):
            async def tracked_stream(request, context):
                if state.draining:
                    await context.abort_with_status(draining_status())
                state.enter()
                try:
                    async for response in behavior(request, context):
                        yield response
                except asyncio.CancelledError:
                    if not state.cut_reason:
                        raise  # the client went away: nobody to tell
                    await context.abort_with_status(shutdown_status(state.cut_reason))
                finally:
                    state.leave()
            return tracked_stream
        if not inspect.iscoroutinefunction(behavior):
            return behavior  # kvhandoff servicers are all async; nothing else to count

        async def tracked(request, context):
            if state.draining:
                await context.abort_with_status(draining_status())
            state.enter()
            try:
                return await behavior(request, context)
            except asyncio.CancelledError:
                if not state.cut_reason:
                    raise
                await context.abort_with_status(shutdown_status(state.cut_reason))
            finally:
                state.leave()
        return tracked


# Clients are asked (GOAWAY) to open a new connection after this long; streams in flight keep
# running (no age grace limit). A client that reconnects re-resolves DNS, which is how decode's
# round_robin channel finds prefill replicas added after it started.
MAX_CONNECTION_AGE_MS = 5 * 60 * 1000


def server_options(max_bytes: int) -> list[tuple[str, int]]:
    """grpc.so_reuseport is off: with it on (gRPC's default) a second server on a taken port
    binds without error and silently takes half of the connections (common/server/ports.py)."""
    return [("grpc.max_send_message_length", max_bytes),
            ("grpc.max_receive_message_length", max_bytes),
            ("grpc.max_connection_age_ms", MAX_CONNECTION_AGE_MS),
            ("grpc.so_reuseport", 0)]


async def create_server(
    register: Callable[[grpc.aio.Server], list[str]], host: str, port: int,
    tls: TlsFiles | None, max_message_bytes: int,
    interceptors: list | None = None, port_setting: str = "--port",
) -> tuple[grpc.aio.Server, int, ServingState]:
    """register adds the servicers and returns their full service names. Health starts at
    NOT_SERVING; the caller flips it once the model is warm. The returned ServingState is the
    health servicer and also tracks in-flight work for the drain on SIGTERM. A port that is
    taken raises PortUnavailable naming it (and port_setting, the flag that chose it)."""
    check_port_free(host, port, port_setting)
    state = ServingState()
    server = grpc.aio.server(options=server_options(max_message_bytes),
                             interceptors=[DrainInterceptor(state), *(interceptors or ())])
    names = register(server)
    health_pb2_grpc.add_HealthServicer_to_server(state, server)
    for name in ["", *names]:
        await state.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    enable_reflection([*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name],
                      server)
    address = f"{host}:{port}"
    try:
        bound = (server.add_secure_port(address, tls.server_credentials()) if tls
                 else server.add_insecure_port(address))
    except RuntimeError as err:  # grpcio: "Failed to bind to address ..."
        raise port_error(host, port, port_setting, None) from err
    if bound == 0:
        raise port_error(host, port, port_setting, None)
    await server.start()
    return server, bound, state


async def set_serving(health_servicer, names: list[str], serving: bool) -> None:
    """Sets every service's status; after a drain has begun, SERVING is ignored."""
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in ["", *names]:
        await health_servicer.set(name, status)


async def drain(server: grpc.aio.Server, state: ServingState, grace: float,
                force: asyncio.Event | None = None, log=None) -> bool:
    """Health NOT_SERVING for good, new work refused (UNAVAILABLE, reason DRAINING), in-flight
    work given up to `grace` seconds (or until `force` is set), then the server stopped; what
    is still running then is cancelled. Returns True when nothing had to be cancelled."""
    await state.begin_drain()
    if log is not None:
        log.info("draining", in_flight=state.in_flight, grace_seconds=grace)
    loop = asyncio.get_running_loop()
    started = loop.time()
    waits = [asyncio.ensure_future(state.wait_idle())]
    if force is not None:
        waits.append(asyncio.ensure_future(force.wait()))
    _done, pending = await asyncio.wait(waits, timeout=grace,
                                        return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    drained = state.in_flight == 0
    forced = force is not None and force.is_set()
    if log is not None:
        log.info("drained" if drained else "drain_cut_short", in_flight=state.in_flight,
                 seconds=round(loop.time() - started, 3))
    if not drained:  # each call still running is told why it ends
        await state.end_calls("a second stop signal" if forced else
                              f"its {grace:g} s drain grace ran out")
    # Drained: only lifecycle calls are left (a peer's health Watch never ends by itself), so
    # waiting out the rest of the grace for them kept an idle server up for its whole grace.
    await server.stop(0 if forced or not drained else STOP_FLUSH_S)
    return drained


async def serve_until_signalled(server: grpc.aio.Server, health_servicer: ServingState,
                                grace: float,
                                on_stop: Callable[[], Awaitable[None]] | None = None,
                                log=None) -> None:
    """Serves until SIGTERM/SIGINT, then drains (see `drain`: every service goes NOT_SERVING
    through the health servicer's shutdown mode); a second signal cuts the drain short.
    on_stop runs after the server has stopped (stop engines, close channels)."""
    stop, force = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        (force if stop.is_set() else stop).set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    server_done = asyncio.ensure_future(server.wait_for_termination())
    stop_wait = asyncio.ensure_future(stop.wait())
    await asyncio.wait([server_done, stop_wait], return_when=asyncio.FIRST_COMPLETED)
    await drain(server, health_servicer, grace, force, log)
    if on_stop is not None:
        await on_stop()
    for task in (server_done, stop_wait):
        task.cancel()


def run_async(main: Callable[[], Awaitable[T]]) -> T:
    """Runs main on uvloop when it is installed and returns its result (an ImportError inside
    main is not swallowed)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main())
    return uvloop.run(main())
