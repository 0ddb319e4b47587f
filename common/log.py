"""structlog JSON logging: one JSON object per line on stderr, one event per request phase.

Every line carries `event`, `level`, `timestamp` (ISO 8601, UTC) and `service` (the role);
request-scoped lines also carry `request_id`, the id decode makes for a request and sends to
prefill both as PrefillRequest.request_id and as `x-request-id` metadata; prefill logs the
metadata's id (the PrefillRequest's when there is none), so one grep joins a request's lines
across the two services, a rejected request without a request_id included. Exceptions are
rendered as structured tracebacks without local variables.
The logger is built per service (structlog.wrap_logger), so nothing global is configured.
"""

from __future__ import annotations

import sys
from typing import TextIO

import structlog

REQUEST_ID_METADATA = "x-request-id"


def make_logger(role: str, stream: TextIO | None = None) -> structlog.typing.FilteringBoundLogger:
    """A JSON logger bound to the role; callers bind request_id per request."""
    processors = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
        # no locals: they could hold prompts, tokens or secrets
        structlog.processors.ExceptionRenderer(
            structlog.tracebacks.ExceptionDictTransformer(show_locals=False)),
        structlog.processors.JSONRenderer(sort_keys=False),
    ]
    logger = structlog.wrap_logger(
        structlog.PrintLogger(file=stream or sys.stderr), processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(0))
    return logger.bind(service=role)


def request_id_from(metadata) -> str:
    """The x-request-id value in gRPC invocation metadata, or ''."""
    for key, value in metadata or ():
        if key == REQUEST_ID_METADATA:
            return value if isinstance(value, str) else value.decode()
    return ""
