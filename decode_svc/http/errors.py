"""Errors on the HTTP API: OpenAI error objects, the HTTP status mapped from the gRPC code.

`{"error": {"message", "type", "param", "code"}}`: `code` is our stable reason (the ErrorInfo
reason a gRPC client sees for the same refusal), `param` the request field at fault (or null).
A code without a mapping is a 500 whose message is the ServiceError's, never a traceback.
"""

from __future__ import annotations

import grpc

from common.errors import ServiceError

C = grpc.StatusCode

HTTP_STATUS: dict[grpc.StatusCode, int] = {
    C.INVALID_ARGUMENT: 400, C.OUT_OF_RANGE: 400, C.UNAUTHENTICATED: 401,
    C.PERMISSION_DENIED: 403, C.NOT_FOUND: 404, C.RESOURCE_EXHAUSTED: 429,
    C.UNAVAILABLE: 503, C.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
               413: "invalid_request_error", 429: "rate_limit_error",
               503: "service_unavailable_error", 504: "timeout_error"}
PARAM_KEY = "param"  # ServiceError.metadata key naming the request field at fault


def bad_request(reason: str, message: str, param: str | None = None) -> ServiceError:
    """A 400 about one field of the request body."""
    return ServiceError(C.INVALID_ARGUMENT, reason, message,
                        {PARAM_KEY: param} if param else {})


def http_status(err: ServiceError) -> int:
    return HTTP_STATUS.get(err.code, 500)


def error_object(err: ServiceError, status: int | None = None) -> dict:
    status = status or http_status(err)
    return {"error": {"message": err.message, "type": ERROR_TYPES.get(status, "server_error"),
                      "param": err.metadata.get(PARAM_KEY), "code": err.reason}}
