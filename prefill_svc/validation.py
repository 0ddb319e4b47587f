"""Prefill's checks of a PrefillRequest, before any page is touched or any forward pass runs."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from common.handoff.binding import NONCE_BYTES
from common.handoff.layout import PROTOCOL_MAJOR, PROTOCOL_MINOR_BOUND
from common.handoff.planes import plane_name
from common.handoff.reasons import REJECTION_CODES
from common.pb.kvhandoff.v1 import handoff_pb2


@dataclass(frozen=True)
class Rejection:
    reason_code: str
    message: str

    @property
    def code(self) -> grpc.StatusCode:
        return REJECTION_CODES[self.reason_code]


@dataclass(frozen=True)
class PrefillLimits:
    vocab_size: int
    context_window: int
    pool_tokens: int
    model_fingerprint: str
    min_chunk_bytes: int  # K+V bytes of one token in one layer: the smallest chunk payload
    # the DataPlane values this prefill serves (UNSPECIFIED is inline)
    data_planes: frozenset[int] = frozenset({handoff_pb2.DATA_PLANE_UNSPECIFIED,
                                             handoff_pb2.DATA_PLANE_INLINE})
    shm_host_id: str = ""  # this prefill's host identity when it serves shared memory


def validate_prefill(request: handoff_pb2.PrefillRequest,
                     limits: PrefillLimits) -> Rejection | None:
    """Returns the first reason to refuse the request, or None when it may be computed."""
    if not request.request_id:
        return Rejection("MISSING_REQUEST_ID", "request_id is empty")
    major = request.protocol_version.major
    if major != PROTOCOL_MAJOR:
        return Rejection("VERSION_UNSUPPORTED",
                         f"protocol major version {major} is not supported; this prefill speaks "
                         f"{PROTOCOL_MAJOR}")
    minor = request.protocol_version.minor
    if minor >= PROTOCOL_MINOR_BOUND and len(request.nonce) < NONCE_BYTES:
        return Rejection("NONCE_INVALID", f"a protocol 1.{minor} request needs a nonce of at least "
                         f"{NONCE_BYTES} random bytes; it has {len(request.nonce)}")
    if request.model_fingerprint and request.model_fingerprint != limits.model_fingerprint:
        return Rejection("MODEL_MISMATCH", f"decode serves model {request.model_fingerprint!r}, "
                         f"this prefill serves {limits.model_fingerprint!r}")
    n = len(request.token_ids)
    if n == 0:
        return Rejection("EMPTY_PROMPT", "the prompt has no tokens")
    bad = next((t for t in request.token_ids if t >= limits.vocab_size), None)
    if bad is not None:
        return Rejection("TOKEN_OUT_OF_VOCAB",
                         f"token id {bad} is outside the vocabulary of {limits.vocab_size}")
    if n > limits.context_window:
        return Rejection("PROMPT_TOO_LONG", f"the prompt has {n} tokens, more than the context "
                         f"window of {limits.context_window}")
    if n > limits.pool_tokens:
        return Rejection("POOL_TOO_SMALL", f"the prompt has {n} tokens but this prefill's KV pool "
                         f"holds only {limits.pool_tokens} tokens even when empty")
    if request.max_chunk_bytes and request.max_chunk_bytes < limits.min_chunk_bytes:
        return Rejection("CHUNK_LIMIT_TOO_SMALL", f"max_chunk_bytes {request.max_chunk_bytes} is "
                         f"below the K+V bytes of one token in one layer "
                         f"({limits.min_chunk_bytes})")
    if request.data_plane not in limits.data_planes:
        served = sorted({plane_name(p) for p in limits.data_planes})
        return Rejection("DATA_PLANE_UNAVAILABLE", f"this prefill does not serve data plane "
                         f"{plane_name(request.data_plane)}; it serves {', '.join(served)}")
    if (request.data_plane == handoff_pb2.DATA_PLANE_SHARED_MEMORY
            and request.data_plane_host_id != limits.shm_host_id):
        return Rejection("DATA_PLANE_UNAVAILABLE", "decode runs on another host or sees another "
                         "shared-memory directory than this prefill "
                         f"({request.data_plane_host_id or 'no host id'} vs {limits.shm_host_id})")
    return None
