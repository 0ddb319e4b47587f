"""Bearer-token check for the client-facing API (health and reflection stay open), by tenant.

Invariant: a call to any other method runs its servicer only when it carries exactly one
`authorization` metadata entry equal to `Bearer <token>` with a token of the table in force
(common.server.tenants: `--api-tokens FILE`, or the single `--api-token` as tenant "default");
every other call is answered UNAUTHENTICATED before the servicer runs, so a refused call
reserves nothing and never reaches prefill. The servicer of an admitted call runs with its
tenant in `call_tenant()` and bound into structlog's context (every log line of the call carries
`tenant`), resolved once here, so a reload during the call cannot change who the call is. Send
tokens only over TLS (--api-tls-cert/--api-tls-key).
"""

from __future__ import annotations

import contextvars
import inspect
from collections.abc import Callable

import grpc
import structlog

from common.errors import ServiceError, abort_with
from common.server.tenants import BEARER_PREFIX, UNAUTHENTICATED, TenantTable, TenantTokens

OPEN_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")
DENIED = "missing or wrong bearer token in the authorization metadata"
_CALL_TENANT: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "kvhandoff_call_tenant", default=None)
_KINDS = {(False, False): grpc.unary_unary_rpc_method_handler,
          (False, True): grpc.unary_stream_rpc_method_handler,
          (True, False): grpc.stream_unary_rpc_method_handler,
          (True, True): grpc.stream_stream_rpc_method_handler}


def call_tenant() -> str | None:
    """The tenant the interceptor admitted the running call as (None outside such a call)."""
    return _CALL_TENANT.get()


def why_refused(metadata) -> str:
    """Why a call's metadata names no tenant, in words that never include the token."""
    sent = [value for key, value in (metadata or ()) if key == "authorization"]
    if not sent:
        return "no authorization metadata"
    if len(sent) > 1:
        return f"{len(sent)} authorization entries"
    value = sent[0] if isinstance(sent[0], str) else sent[0].decode("latin-1")
    if not value.startswith(BEARER_PREFIX):
        return "not a 'Bearer <token>' value"
    return "unknown token"


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

        return _KINDS[(request_streaming, True)](
            deny_stream, request_deserializer=deserialize, response_serializer=serialize)

    async def deny(request, context):
        await abort_with(context, ServiceError(
            grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED", DENIED))

    return _KINDS[(request_streaming, False)](
        deny, request_deserializer=deserialize, response_serializer=serialize)


def _enter(tenant: str) -> None:
    """Runs in the call's own task (grpc.aio runs each call in one), so neither value leaks
    to another call."""
    _CALL_TENANT.set(tenant)
    structlog.contextvars.bind_contextvars(tenant=tenant)


def _as_tenant(handler: grpc.RpcMethodHandler | None, tenant: str):
    """handler, its servicer run with the call's tenant set (None stays None: UNIMPLEMENTED)."""
    if handler is None:
        return None
    behavior = (handler.unary_unary or handler.unary_stream or handler.stream_unary
                or handler.stream_stream)
    if inspect.isasyncgenfunction(behavior):
        async def as_tenant_stream(request, context):
            _enter(tenant)
            async for response in behavior(request, context):
                yield response
        wrapped = as_tenant_stream
    elif inspect.iscoroutinefunction(behavior):
        async def as_tenant(request, context):
            _enter(tenant)
            return await behavior(request, context)
        wrapped = as_tenant
    else:
        return handler  # kvhandoff servicers are all async; a sync one runs without a tenant
    return _KINDS[(handler.request_streaming, handler.response_streaming)](
        wrapped, handler.request_deserializer, handler.response_serializer)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """tokens: the table in force (a TenantTokens, reloaded elsewhere) or one token (tenant
    "default"). on_call(tenant) counts each call that is not open, with UNAUTHENTICATED for a
    refused one; log gets one `call_unauthenticated` line per refusal."""

    def __init__(self, tokens: TenantTokens | str, log=None,
                 on_call: Callable[[str], None] | None = None) -> None:
        self.tokens = tokens if isinstance(tokens, TenantTokens) else TenantTokens(
            TenantTable.single(tokens))
        self.log = log
        self.on_call = on_call

    def authorized(self, metadata) -> bool:
        """True for exactly one authorization entry `Bearer <a token of the table>`."""
        return self.tokens.tenant_of(metadata) is not None

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method or ""
        if method.startswith(OPEN_PREFIXES):
            return await continuation(handler_call_details)
        metadata = handler_call_details.invocation_metadata
        tenant = self.tokens.tenant_of(metadata)
        if self.on_call is not None:
            self.on_call(tenant or UNAUTHENTICATED)
        if tenant is not None:
            return _as_tenant(await continuation(handler_call_details), tenant)
        if self.log is not None:
            self.log.warning("call_unauthenticated", method=method, why=why_refused(metadata))
        return _denying(await continuation(handler_call_details))
