"""Bearer-token check for the client-facing API (health and reflection stay open).

Invariant: a call to any other method runs its servicer only when it carries exactly one
`authorization` metadata entry equal to `Bearer <token>` (compared in constant time); every other
call is answered UNAUTHENTICATED before the servicer runs, so a refused call reserves nothing and
never reaches prefill. Send the token only over TLS (--api-tls-cert/--api-tls-key).
"""

from __future__ import annotations

import hmac

import grpc

from common.errors import ServiceError, abort_with

OPEN_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")
DENIED = "missing or wrong bearer token in the authorization metadata"


def _denying(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    """A handler of the same kind as handler (unary or streaming each way) that only refuses."""
    request_streaming = bool(handler and handler.request_streaming)
    response_streaming = bool(handler and handler.response_streaming)
    deserialize = handler.request_deserializer if handler else None
    serialize = handler.response_serializer if handler else None
    if response_streaming:
        async def deny_stream(request, context):
            await abort_with(context, ServiceError(
                grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED", DENIED))
            yield  # pragma: no cover - makes this an async generator

        make = (grpc.stream_stream_rpc_method_handler if request_streaming
                else grpc.unary_stream_rpc_method_handler)
        return make(deny_stream, request_deserializer=deserialize, response_serializer=serialize)

    async def deny(request, context):
        await abort_with(context, ServiceError(
            grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED", DENIED))

    make = (grpc.stream_unary_rpc_method_handler if request_streaming
            else grpc.unary_unary_rpc_method_handler)
    return make(deny, request_deserializer=deserialize, response_serializer=serialize)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("the API token is empty")
        self._expected = f"Bearer {token}".encode()

    def authorized(self, metadata) -> bool:
        """True for exactly one authorization entry equal to the expected bearer value."""
        sent = [value for key, value in (metadata or ()) if key == "authorization"]
        if len(sent) != 1:
            return False
        value = sent[0] if isinstance(sent[0], bytes) else sent[0].encode()
        return hmac.compare_digest(value, self._expected)

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method or ""
        if method.startswith(OPEN_PREFIXES) or self.authorized(
                handler_call_details.invocation_metadata):
            return await continuation(handler_call_details)
        return _denying(await continuation(handler_call_details))
