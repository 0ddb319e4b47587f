"""Every way a handoff is refused: a stable reason code and the gRPC status the client sees.

The codes are part of protocol v1 (SPEC.md lists them); never rename one.
"""

from __future__ import annotations

import grpc

from common.errors import ServiceError

C = grpc.StatusCode

# reason code -> gRPC status code seen by the client of decode
REFUSAL_CODES: dict[str, grpc.StatusCode] = {
    "PEER_REJECTED": C.FAILED_PRECONDITION,
    "PEER_ABORTED": C.ABORTED,
    "STATUS_UNSPECIFIED": C.INTERNAL,
    "HEADER_MISSING": C.INTERNAL,
    "HEADER_DUPLICATE": C.INTERNAL,
    "FRAME_EMPTY": C.INTERNAL,
    "FRAME_MALFORMED": C.INTERNAL,
    "FRAME_AFTER_COMMIT": C.INTERNAL,
    "REQUEST_ID_MISMATCH": C.INTERNAL,
    "TOKEN_COUNT_MISMATCH": C.INTERNAL,
    "VERSION_UNSUPPORTED": C.FAILED_PRECONDITION,
    "MODEL_MISMATCH": C.FAILED_PRECONDITION,
    "LAYOUT_MISMATCH": C.FAILED_PRECONDITION,
    "CHUNK_SEQUENCE_GAP": C.INTERNAL,
    "CHUNK_LAYER_OUT_OF_RANGE": C.INTERNAL,
    "CHUNK_RANGE_INVALID": C.INTERNAL,
    "CHUNK_OVERLAP": C.INTERNAL,
    "CHUNK_SIZE_MISMATCH": C.INTERNAL,
    "CHECKSUM_MISMATCH": C.DATA_LOSS,
    "FRAME_TOO_LARGE": C.RESOURCE_EXHAUSTED,
    "COMMIT_MISSING": C.INTERNAL,
    "COMMIT_MISMATCH": C.INTERNAL,
    "COVERAGE_INCOMPLETE": C.INTERNAL,
    "FIRST_TOKEN_INVALID": C.INTERNAL,
    "HANDOFF_TIMEOUT": C.DEADLINE_EXCEEDED,
    "PEER_UNAVAILABLE": C.UNAVAILABLE,
    # protocol 1.1: the handoff bound to its request
    "NONCE_MISMATCH": C.INTERNAL,
    "PROMPT_DIGEST_MISMATCH": C.INTERNAL,
    "FRAME_CHECKSUM_MISMATCH": C.DATA_LOSS,
    # 1.1: decode's checks of the KV content, after the commit and before any token
    "KV_NOT_FINITE": C.DATA_LOSS,
    "KV_LAYER0_MISMATCH": C.DATA_LOSS,
    "KV_DEPTH_MISMATCH": C.DATA_LOSS,
    # 1.2: the commit's count of prompt tokens served from prefill's cache is out of bounds
    "CACHED_TOKENS_INVALID": C.INTERNAL,
}

# Prefill's rejection reason codes (header.reason_code) -> status the client of decode sees.
REJECTION_CODES: dict[str, grpc.StatusCode] = {
    "EMPTY_PROMPT": C.INVALID_ARGUMENT,
    "TOKEN_OUT_OF_VOCAB": C.INVALID_ARGUMENT,
    "PROMPT_TOO_LONG": C.INVALID_ARGUMENT,
    "POOL_TOO_SMALL": C.RESOURCE_EXHAUSTED,
    "MISSING_REQUEST_ID": C.INVALID_ARGUMENT,
    "VERSION_UNSUPPORTED": C.FAILED_PRECONDITION,
    "MODEL_MISMATCH": C.FAILED_PRECONDITION,
    "CHUNK_LIMIT_TOO_SMALL": C.INVALID_ARGUMENT,
    "NONCE_INVALID": C.INVALID_ARGUMENT,
    # data planes: prefill does not serve the plane the request names (SPEC.md section 10)
    "DATA_PLANE_UNAVAILABLE": C.FAILED_PRECONDITION,
}

# Refusals of out-of-band planes (SPEC.md section 10.3): the bytes a chunk refers to could not
# be landed. Listed apart from REFUSAL_CODES (SPEC 10.3); of these the inline conformance suite
# provokes only REFERENCE_UNEXPECTED (a reference on an inline handoff).
PLANE_REFUSAL_CODES: dict[str, grpc.StatusCode] = {
    "REGION_INVALID": C.DATA_LOSS,
    "REFERENCE_UNEXPECTED": C.INTERNAL,
    # NIXL: the READ of a chunk's bytes failed (prefill's agent gone), or did not complete in time
    "TRANSFER_FAILED": C.UNAVAILABLE,
    "TRANSFER_TIMEOUT": C.DEADLINE_EXCEEDED,
}


class HandoffRefused(ServiceError):
    """Decode refused a handoff; reason is one of REFUSAL_CODES."""


def refuse(reason: str, message: str, code: grpc.StatusCode | None = None) -> HandoffRefused:
    return HandoffRefused(code or REFUSAL_CODES.get(reason) or PLANE_REFUSAL_CODES[reason],
                          reason, message)
