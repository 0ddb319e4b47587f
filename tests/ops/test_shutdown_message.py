"""A call that a shutdown ends is told why: UNAVAILABLE (DRAINING) with a message naming the
shutdown and what to do, not gRPC's bare "Cancelling all calls", and the handler still sees the
cancellation it frees its resources on."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from common.server.grpc_server import create_server, drain, set_serving
from tests.helpers.polling import await_until
from tests.ops.test_drain import SERVICE, SlowService, _reason


async def test_a_stream_cut_by_the_grace_time_is_told_the_server_shut_down():
    slow = SlowService()
    server, port, state = await create_server(slow.register, "127.0.0.1", 0, None, 1 << 20)
    await set_serving(state, [SERVICE], True)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stream = channel.unary_stream(f"/{SERVICE}/Stream")(b"x", timeout=60)
        unary = asyncio.ensure_future(channel.unary_unary(f"/{SERVICE}/Wait")(b"x", timeout=60))
        assert await stream.read() == b"first"
        await await_until(lambda: state.in_flight == 2, 10, "two calls in flight")
        assert await drain(server, state, grace=0.2) is False
        with pytest.raises(grpc.aio.AioRpcError) as cut:
            await stream.read()
        with pytest.raises(grpc.aio.AioRpcError) as cut_unary:
            await unary
    for err in (cut.value, cut_unary.value):
        assert err.code() == grpc.StatusCode.UNAVAILABLE, err
        assert err.details() == ("the server shut down before this request finished (its 0.2 s "
                                 "drain grace ran out); retry on another replica"), err.details()
        assert _reason(err) == "DRAINING"
    assert slow.cancelled == 1  # the unary handler saw its CancelledError (and could free)
    assert state.in_flight == 0


async def test_a_second_signal_is_named_as_the_reason():
    slow = SlowService()
    server, port, state = await create_server(slow.register, "127.0.0.1", 0, None, 1 << 20)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = asyncio.ensure_future(channel.unary_unary(f"/{SERVICE}/Wait")(b"x", timeout=60))
        await await_until(lambda: state.in_flight == 1, 10, "call in flight")
        force = asyncio.Event()
        force.set()
        assert await drain(server, state, grace=600, force=force) is False
        with pytest.raises(grpc.aio.AioRpcError) as cut:
            await call
    assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "shut down before this request finished (a second stop signal)" in cut.value.details()
