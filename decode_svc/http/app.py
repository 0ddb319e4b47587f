"""The OpenAI-compatible HTTP API on decode: an aiohttp app on the event loop grpc.aio runs.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (whole or streamed as
server-sent events), GET /health (200 once serving, else 503), GET /metrics (the service's
Prometheus registry, as vLLM serves it on its API port).

Invariants: a generation goes through the same RequestLifecycle as gRPC Generate (admit,
hand off, verify, join, stream, finish: same checks, logs, metrics, page release); /v1/* needs
`Authorization: Bearer <token>` checked by the tenant table gRPC uses (health and metrics stay
open, as gRPC health does); a client that disconnects cancels its handler (aiohttp's
handler_cancellation), which cancels the lifecycle and frees its pages; a reader slower than
generation is backpressured by the socket (a stream's socket send buffer and the transport's
write buffer together hold about StreamLimits.buffer_bytes; past that each write awaits the
transport's drain, and the request's token events wait in its own queue, at most max_tokens of
them), and one whose write waits StreamLimits.slow_reader_s is cut off (its connection closed)
and its pages freed. The HTTP
status comes from the lifecycle's gRPC code (decode_svc.http.errors); a refusal before the
first token is a plain error response, one after it (the stream has begun) is an SSE error
event followed by [DONE].
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import time
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass

import grpc
import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from common.errors import ServiceError
from common.server.ports import check_port_free, port_error
from common.server.tenants import UNAUTHENTICATED
from decode_svc.cache_scope import tenant_identity
from decode_svc.http.errors import error_object, http_status
from decode_svc.http.requests import OpenAiRequest, parse_request
from decode_svc.http.responses import DONE, Reply, sse
from decode_svc.lifecycle import Admitted, Finished, RequestLifecycle

C = grpc.StatusCode
MAX_BODY_BYTES = 32 << 20
DENIED = "missing or wrong bearer token in the Authorization header"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "Connection": "keep-alive"}


def error_response(err: ServiceError, status: int | None = None) -> web.Response:
    status = status or http_status(err)
    return web.json_response(error_object(err, status), status=status)


@web.middleware
async def errors_as_objects(request: web.Request, handler):
    """aiohttp's own refusals (404, 405, 413) and anything unexpected as OpenAI error objects;
    a crash is a 500 with one line, the traceback only in the log."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        reason = {404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED",
                  413: "REQUEST_TOO_LARGE"}.get(exc.status, "HTTP_ERROR")
        return error_response(ServiceError(C.UNKNOWN, reason, f"{exc.reason}: {request.method} "
                                           f"{request.path}"), exc.status)
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception as exc:
        request.app["log"].exception("http_crashed", path=request.path, error=str(exc))
        return error_response(ServiceError(C.INTERNAL, "INTERNAL", f"decode failed: {exc}"))


@dataclass(frozen=True)
class StreamLimits:
    """How much a streamed response may wait for and hold for a slow client
    (--http-slow-reader-s, --http-stream-buffer-bytes)."""

    slow_reader_s: float = 30.0
    buffer_bytes: int = 256 << 10

    @classmethod
    def from_config(cls, config) -> StreamLimits:
        return cls(config.http_slow_reader_s, config.http_stream_buffer_bytes)


def bound_stream_buffers(request: web.Request, buffer_bytes: int) -> None:
    """Caps what one stream's connection queues for its client at about buffer_bytes: half in
    the socket's send buffer (fixed, instead of the kernel's autotuning up to megabytes), half
    in the transport's write buffer."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes // 4)  # Linux doubles
    transport.set_write_buffer_limits(high=buffer_bytes // 2)


class OpenAiApi:
    """tenant_of: the check of the tenant table the gRPC interceptor uses (metadata -> tenant
    or None; None: no auth), on_call: its per-tenant call count; serving: the gRPC server's
    ServingState (the drain and the in-flight count are shared with gRPC)."""

    def __init__(self, lifecycle: RequestLifecycle, model_id: str, serving, registry, log,
                 tenant_of: Callable[[list], str | None] | None = None,
                 on_call: Callable[[str], None] | None = None,
                 limits: StreamLimits | None = None) -> None:
        self.limits = limits or StreamLimits()
        self.lifecycle = lifecycle
        self.model_id = model_id
        self.tenant_of = tenant_of
        self.on_call = on_call
        self.serving = serving
        self.registry = registry
        self.log = log
        self.created = int(time.time())

    def app(self) -> web.Application:
        app = web.Application(middlewares=[errors_as_objects], client_max_size=MAX_BODY_BYTES)
        app["log"] = self.log
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", lambda r: self.generate(r, chat=False))
        app.router.add_post("/v1/chat/completions", lambda r: self.generate(r, chat=True))
        return app

    # ---- open routes ----
    async def health(self, request: web.Request) -> web.Response:
        try:
            self.lifecycle.limits()
            self._check_not_draining()
        except ServiceError as err:
            return error_response(err)
        return web.Response(status=200)

    async def metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    # ---- /v1 ----
    async def models(self, request: web.Request) -> web.Response:
        try:
            self._identity(request)
        except ServiceError as err:
            return error_response(err)
        limits = self.lifecycle.state.limits
        card = {"id": self.model_id, "object": "model", "created": self.created,
                "owned_by": "kvhandoff", "root": self.model_id,
                "max_model_len": limits.context_window if limits else None}
        return web.json_response({"object": "list", "data": [card]})

    async def generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            identity = self._identity(request)
            parsed = self._parse(await self._body(request), chat)
            self._check_not_draining()
            admitted = self.lifecycle.admit(parsed.generate, identity)
        except ServiceError as err:
            return error_response(err)
        reply = Reply(chat, admitted.request_id, self.model_id)
        self.serving.enter()
        try:
            if parsed.stream:
                return await self._stream(request, admitted, reply, parsed.include_usage)
            return await self._whole(admitted, reply)
        finally:
            self.serving.leave()

    def _identity(self, request: web.Request) -> bytes:
        if self.tenant_of is None:
            return b""
        metadata = [("authorization", v) for v in request.headers.getall("Authorization", [])]
        tenant = self.tenant_of(metadata)
        if self.on_call is not None:
            self.on_call(tenant or UNAUTHENTICATED)
        if tenant is None:
            self.log.warning("call_unauthenticated", method=f"{request.method} {request.path}")
            raise ServiceError(C.UNAUTHENTICATED, "UNAUTHENTICATED", DENIED)
        structlog.contextvars.bind_contextvars(tenant=tenant)  # this handler's task only
        return tenant_identity(tenant)

    async def _body(self, request: web.Request) -> object:
        try:
            return json.loads(await request.read())
        except (ValueError, UnicodeDecodeError) as err:
            raise ServiceError(C.INVALID_ARGUMENT, "INVALID_JSON",
                               f"the request body is not valid JSON: {err}") from None

    def _parse(self, body: object, chat: bool) -> OpenAiRequest:
        parsed = parse_request(body, chat)
        if parsed.model is not None and parsed.model != self.model_id:
            raise ServiceError(C.NOT_FOUND, "MODEL_NOT_FOUND",
                               f"the model {parsed.model!r} is not served here; this server "
                               f"serves {self.model_id!r} (GET /v1/models)", {"param": "model"})
        return parsed

    def _check_not_draining(self) -> None:
        if self.serving.draining:
            raise ServiceError(C.UNAVAILABLE, "DRAINING", "the server is shutting down and "
                               "takes no new requests; retry on another replica")

    async def _whole(self, admitted: Admitted, reply: Reply) -> web.Response:
        pieces: list[str] = []
        finished: Finished | None = None
        try:  # read to the end: the lifecycle logs and counts the finish after its last event
            async with aclosing(self.lifecycle.generate(admitted, None)) as events:
                async for event in events:
                    pieces.append(event.text)
                    if isinstance(event, Finished):
                        finished = event
        except ServiceError as err:
            return error_response(err)
        if finished is None:
            return error_response(ServiceError(C.INTERNAL, "INTERNAL",
                                               "the generation ended without finishing"))
        return web.json_response(reply.whole("".join(pieces), finished),
                                 headers={"X-Request-Id": admitted.request_id})

    async def _stream(self, request: web.Request, admitted: Admitted, reply: Reply,
                      include_usage: bool) -> web.StreamResponse:
        response: web.StreamResponse | None = None

        async def send(data: bytes) -> None:
            if data:
                async with asyncio.timeout(self.limits.slow_reader_s):
                    await response.write(data)

        try:
            async with aclosing(self.lifecycle.generate(admitted, None)) as events:
                async for event in events:
                    if response is None:  # after the handoff: a refusal before is a status
                        response = web.StreamResponse(
                            headers={**SSE_HEADERS, "X-Request-Id": admitted.request_id})
                        await response.prepare(request)
                        bound_stream_buffers(request, self.limits.buffer_bytes)
                        await send(reply.first_chunk())
                    if isinstance(event, Finished):
                        await send(reply.final_chunks(event.text, event, include_usage))
                    elif event.text:
                        await send(reply.text_chunk(event.text))
        except ServiceError as err:
            if response is None:
                return error_response(err)
            try:
                await send(sse(error_object(err)) + DONE)
            except (TimeoutError, ConnectionError):  # not reading, or gone: nothing more to say
                if request.transport is not None:
                    request.transport.abort()
        except TimeoutError:
            admitted.log.warning("client_too_slow", seconds=self.limits.slow_reader_s,
                                 message="the client read nothing for this long; the request "
                                         "was cancelled and its pages freed")
            if request.transport is not None:  # what it holds is never read: drop it
                request.transport.abort()
        except ConnectionError:
            pass  # the client went away mid-write: the lifecycle was closed and released
        return response


async def start_http(api: OpenAiApi, host: str, port: int, ssl_context=None
                     ) -> tuple[web.AppRunner, int]:
    """Serves api on host:port (0: a free one); returns the runner (await runner.cleanup() to
    stop) and the bound port. A taken port raises PortUnavailable naming --http-port."""
    check_port_free(host, port, "--http-port")
    runner = web.AppRunner(api.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context, reuse_port=False)
    try:
        await site.start()
    except OSError as err:
        await runner.cleanup()
        raise port_error(host, port, "--http-port", err) from err
    return runner, runner.addresses[0][1]


def tls_context(cert: str, key: str) -> ssl.SSLContext:
    """The client API's TLS (--api-tls-cert/--api-tls-key), the same files gRPC serves."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    return context


async def serve_openai(config, lifecycle: RequestLifecycle, serving, registry, auth, log
                       ) -> tuple[web.AppRunner | None, int]:
    """Decode's HTTP API per its settings (config: DecodeConfig; auth: its TenantAuth or None):
    (None, -1) when --http-port is -1, else the runner and the bound port. Same host, TLS files
    and tokens as the gRPC client API."""
    svc = config.service
    if config.http_port < 0:
        return None, -1
    api = OpenAiApi(lifecycle, svc.model, serving, registry, log,
                    auth.tokens.tenant_of if auth else None, auth.metrics.call if auth else None,
                    StreamLimits.from_config(config))
    tls = tls_context(config.api_tls_cert, config.api_tls_key) if config.api_tls_cert else None
    return await start_http(api, svc.host, config.http_port, tls)
