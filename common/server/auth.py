"""Bearer-token check for the client-facing API (health and reflection stay open)."""

from __future__ import annotations

import hmac

import grpc

OPEN_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "missing or wrong bearer token in the authorization metadata")

        self._deny = deny

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(OPEN_PREFIXES):
            return await continuation(handler_call_details)
        sent = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(sent.encode() if isinstance(sent, str) else sent, self._expected):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is not None and handler.response_streaming and not handler.request_streaming:
            async def deny_stream(request, context):
                await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                    "missing or wrong bearer token in the authorization metadata")
                yield  # pragma: no cover - makes this an async generator
            return grpc.unary_stream_rpc_method_handler(
                deny_stream, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(
            self._deny, request_deserializer=handler.request_deserializer if handler else None,
            response_serializer=handler.response_serializer if handler else None)
