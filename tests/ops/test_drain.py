"""Draining on SIGTERM: health says NOT_SERVING (and keeps answering) while in-flight work
finishes, new work is refused with UNAVAILABLE/DRAINING, then the server stops.

In-process tests drive `drain` on a real grpc.aio server; the end-to-end test sends SIGTERM
to a decode process that holds a request (its prefill is paused with SIGSTOP, so the request
is in flight for as long as the test needs, without timing)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from kvhandoff_cli.health_probe import check
from common.server.grpc_server import create_server, drain, set_serving
from tests.faults.waits import wait_pages_taken
from tests.helpers.cluster import start_cluster
from tests.helpers.polling import await_until, wait_until
from tests.ops.helpers import generate_reply

SERVICE = "test.Slow"
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class SlowService:
    """Wait (unary) and Stream (server streaming) block until `release` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.cancelled = 0

    async def wait(self, request: bytes, context) -> bytes:
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return b"done"

    async def stream(self, request: bytes, context):
        yield b"first"
        await self.release.wait()
        yield b"second"

    def register(self, server: grpc.aio.Server) -> list[str]:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
            "Wait": grpc.unary_unary_rpc_method_handler(self.wait),
            "Stream": grpc.unary_stream_rpc_method_handler(self.stream)}),))
        return [SERVICE]


def _reason(err: grpc.aio.AioRpcError) -> str:
    status = rpc_status.from_call(err)
    info = error_details_pb2.ErrorInfo()
    status.details[0].Unpack(info)
    return info.reason


async def test_drain_keeps_health_answering_and_finishes_in_flight_work():
    slow = SlowService()
    server, port, state = await create_server(slow.register, "127.0.0.1", 0, None, 1 << 20)
    await set_serving(state, [SERVICE], True)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        wait = channel.unary_unary(f"/{SERVICE}/Wait")
        stream = channel.unary_stream(f"/{SERVICE}/Stream")
        health = health_pb2_grpc.HealthStub(channel)
        unary_call = asyncio.ensure_future(wait(b"x", timeout=60))
        stream_call = stream(b"x", timeout=60)
        assert await stream_call.read() == b"first"
        await await_until(lambda: state.in_flight == 2, 10, "two calls in flight")
        drained = asyncio.ensure_future(drain(server, state, grace=60))
        await await_until(lambda: state.draining, 10, "drain started")
        for name in ("", SERVICE):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert reply.status == NOT_SERVING
        await set_serving(state, [SERVICE], True)  # a late warm-up must not undo the drain
        reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await wait(b"new", timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert _reason(refused.value) == "DRAINING"
        assert not drained.done() and state.in_flight == 2
        slow.release.set()
        assert await unary_call == b"done"
        assert await stream_call.read() == b"second"
        assert await drained is True
    assert state.in_flight == 0 and slow.cancelled == 0


async def test_drain_cancels_what_outlives_the_grace_time():
    slow = SlowService()
    server, port, state = await create_server(slow.register, "127.0.0.1", 0, None, 1 << 20)
    await set_serving(state, [SERVICE], True)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = asyncio.ensure_future(channel.unary_unary(f"/{SERVICE}/Wait")(b"x", timeout=60))
        await await_until(lambda: state.in_flight == 1, 10, "call in flight")
        assert await drain(server, state, grace=0.2) is False
        with pytest.raises(grpc.aio.AioRpcError):
            await call
    await await_until(lambda: state.in_flight == 0, 10, "cancelled call counted out")
    assert slow.cancelled == 1


async def test_forced_drain_stops_at_once():
    slow = SlowService()
    server, port, state = await create_server(slow.register, "127.0.0.1", 0, None, 1 << 20)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = asyncio.ensure_future(channel.unary_unary(f"/{SERVICE}/Wait")(b"x", timeout=60))
        await await_until(lambda: state.in_flight == 1, 10, "call in flight")
        force = asyncio.Event()
        force.set()  # a second SIGTERM
        assert await drain(server, state, grace=600, force=force) is False
        with pytest.raises(grpc.aio.AioRpcError):
            await call


@pytest.mark.slow
def test_decode_drains_on_sigterm_with_a_request_in_flight(tmp_path):
    cluster = start_cluster(tmp_path, "demo", common_flags=["--pool-tokens", "4096"],
                            decode_flags=["--grace-seconds", "300"])
    paused = False
    try:
        os.kill(cluster.prefill.proc.pid, signal.SIGSTOP)
        paused = True
        result: dict = {}

        def in_flight() -> None:
            try:
                result["reply"] = generate_reply(cluster.address, list(range(3, 30)), 5)
            except grpc.RpcError as err:
                result["error"] = err

        thread = threading.Thread(target=in_flight)
        thread.start()
        wait_pages_taken(cluster.decode)
        cluster.decode.proc.send_signal(signal.SIGTERM)

        def not_serving() -> bool:
            assert cluster.decode.proc.poll() is None, "decode exited with a request in flight"
            return check(cluster.decode.address, timeout=5) == "NOT_SERVING"

        wait_until(not_serving, 60, "decode reports NOT_SERVING")
        with pytest.raises(grpc.RpcError) as refused:
            generate_reply(cluster.address, [5, 6, 7], 2, timeout=30)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in refused.value.details()
        assert cluster.decode.proc.poll() is None and thread.is_alive()
        os.kill(cluster.prefill.proc.pid, signal.SIGCONT)
        paused = False
        thread.join(timeout=120)
        assert "error" not in result, result
        assert result["reply"].completion_tokens == 5
        assert cluster.decode.proc.wait(timeout=60) == 0
    finally:
        if paused:
            os.kill(cluster.prefill.proc.pid, signal.SIGCONT)
        cluster.stop()
