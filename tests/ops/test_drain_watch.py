"""A drained server stops although a peer still watches its health: decode keeps a
grpc.health.v1 Watch stream open on every prefill replica, and that stream never ends by
itself, so waiting out the rest of the grace for it kept a prefill with nothing left to do
alive for its whole drain grace (30 s in compose: `--scale prefill=1` took 36 s to remove a
replica). The watcher is told NOT_SERVING first, then its stream ends."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.server.grpc_server import create_server, drain, set_serving
from tests.ops.test_drain import SERVICE, SlowService


@pytest.mark.timeout(120)  # without the fix, drain waits out its 600 s grace
async def test_a_drained_server_stops_without_waiting_for_health_watchers():
    server, port, state = await create_server(SlowService().register, "127.0.0.1", 0, None,
                                              1 << 20)
    await set_serving(state, [SERVICE], True)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=SERVICE), timeout=900)
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        assert await drain(server, state, grace=600) is True
        seen, ended = [], ""
        while not ended:  # the stream ends (the server stopped it), or this test times out
            try:
                reply = await watch.read()
            except grpc.aio.AioRpcError as err:
                ended = err.code().name
            else:
                if reply is grpc.aio.EOF:
                    ended = "EOF"
                else:
                    seen.append(reply.status)
    assert seen[:1] == [health_pb2.HealthCheckResponse.NOT_SERVING], seen
    assert ended in ("EOF", "CANCELLED", "UNAVAILABLE"), ended
