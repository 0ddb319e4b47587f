"""Protocol 1.1's binding fields as SPEC.md section 3.1 defines them, written from the spec for
the suite alone (it does not import the services' code): the prompt digest, and the chunk and
commit checksums over the canonical metadata encoding."""

from __future__ import annotations

import hashlib
import struct

import google_crc32c

from common.pb.kvhandoff.v1 import handoff_pb2

MIN_NONCE_BYTES = 16


def digest_of(token_ids) -> bytes:
    """SHA-256 of the token ids, each a little-endian uint32."""
    return hashlib.sha256(struct.pack(f"<{len(token_ids)}I", *token_ids)).digest()


def _lp(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


def chunk_crc(c: handoff_pb2.KvChunk, nonce: bytes | None = None) -> int:
    """CRC-32C of k || v || request id, nonce, sequence number, layer, start, end."""
    meta = (_lp(c.request_id.encode()) + _lp(c.nonce if nonce is None else nonce)
            + struct.pack("<QIII", c.sequence_number, c.layer, c.token_start, c.token_end))
    return google_crc32c.value(c.k + c.v + meta)


def commit_crc(c: handoff_pb2.HandoffCommit, nonce: bytes | None = None) -> int:
    """CRC-32C of request id, nonce, token count, chunk count, first token, status, then (1.2)
    the cached token count when it is not 0."""
    cached = struct.pack("<I", c.cached_tokens) if c.cached_tokens else b""
    return google_crc32c.value(
        _lp(c.request_id.encode()) + _lp(c.nonce if nonce is None else nonce)
        + struct.pack("<IQII", c.token_count, c.chunk_count, c.first_token_id, c.status)
        + cached)
