"""The bearer-token interceptor in-process: refuses every kind of method the same way and lets
health and reflection through, without starting a model."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.server.auth import BearerTokenInterceptor

TOKEN = "tok"
ECHO = "/test.Echo/"


def _identity(data: bytes) -> bytes:
    return data


def _echo_handlers() -> grpc.GenericRpcHandler:
    async def unary_unary(request, context):
        return request

    async def unary_stream(request, context):
        yield request
        yield request

    async def stream_unary(requests, context):
        return b"".join([r async for r in requests])

    async def stream_stream(requests, context):
        async for r in requests:
            yield r

    kinds = {"UnaryUnary": grpc.unary_unary_rpc_method_handler(unary_unary),
             "UnaryStream": grpc.unary_stream_rpc_method_handler(unary_stream),
             "StreamUnary": grpc.stream_unary_rpc_method_handler(stream_unary),
             "StreamStream": grpc.stream_stream_rpc_method_handler(stream_stream)}
    return grpc.method_handlers_generic_handler("test.Echo", kinds)


@pytest.fixture
async def server():
    srv = grpc.aio.server(interceptors=[BearerTokenInterceptor(TOKEN)])
    srv.add_generic_rpc_handlers([_echo_handlers()])
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    yield f"127.0.0.1:{port}"
    await srv.stop(0)


async def _call(channel: grpc.aio.Channel, kind: str, metadata) -> list[bytes]:
    method = ECHO + kind
    if kind == "UnaryUnary":
        return [await channel.unary_unary(method)(b"x", metadata=metadata, timeout=5)]
    if kind == "UnaryStream":
        return [r async for r in channel.unary_stream(method)(b"x", metadata=metadata, timeout=5)]
    requests = iter(())  # no request messages: a refused call must not race the client's writes
    if kind == "StreamUnary":
        return [await channel.stream_unary(method)(requests, metadata=metadata, timeout=5)]
    return [r async for r in channel.stream_stream(method)(requests, metadata=metadata, timeout=5)]


KINDS = ["UnaryUnary", "UnaryStream", "StreamUnary", "StreamStream"]


@pytest.mark.parametrize("kind", KINDS)
async def test_every_kind_of_method_needs_the_token(server, kind):
    async with grpc.aio.insecure_channel(server) as channel:
        await _call(channel, kind, (("authorization", f"Bearer {TOKEN}"),))  # no error
        for metadata in (None, (("authorization", "Bearer nope"),),
                         (("authorization", f"bearer {TOKEN}"),)):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _call(channel, kind, metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_an_unknown_method_is_unauthenticated_without_the_token(server):
    async with grpc.aio.insecure_channel(server) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await channel.unary_unary("/test.Nothing/Here")(b"x", timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_health_is_open(server):
    async with grpc.aio.insecure_channel(server) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_an_empty_token_is_refused_at_start():
    with pytest.raises(ValueError):
        BearerTokenInterceptor("")
