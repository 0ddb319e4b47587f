"""structlog JSON logging: one line per event, the service role and request id bound."""

from __future__ import annotations

import logging
import sys

import structlog


def make_logger(role: str) -> structlog.stdlib.BoundLogger:
    """A JSON logger to stderr bound to the role; callers bind request_id per request."""
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.JSONRenderer(),
        ],
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    return structlog.get_logger().bind(service=role)
