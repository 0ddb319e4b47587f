"""What binds a handoff to the request it answers (protocol 1.1, SPEC.md section 3.1).

- the nonce: fresh random bytes that decode sends and every frame echoes;
- the prompt digest: SHA-256 of the token ids prefill computed, each a little-endian uint32;
- the chunk checksum: CRC-32C of K, V, then the chunk's metadata, so a chunk relabelled to
  another layer, range, request or handoff no longer matches; the metadata goes last so that
  the payload is read once: `extend(crc32c(k || v), meta)` gives it from the 1.0 payload crc;
- the commit checksum: CRC-32C of the commit's fields.

Canonical metadata encoding: each string or bytes field as a uint32 little-endian length then
its bytes; each integer little-endian, of the width named below. One function per frame builds
it, and both sides use the same function.
"""

from __future__ import annotations

import hashlib
import secrets
import struct

import google_crc32c
import numpy as np

NONCE_BYTES = 16
DIGEST_BYTES = 32


def new_nonce() -> bytes:
    """NONCE_BYTES unguessable bytes for one handoff."""
    return secrets.token_bytes(NONCE_BYTES)


def prompt_digest(token_ids) -> bytes:
    """SHA-256 over the token ids as little-endian uint32 values."""
    return hashlib.sha256(np.asarray(token_ids, dtype="<u4").tobytes()).digest()


def _field(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


def chunk_metadata(request_id: str, nonce: bytes, sequence_number: int, layer: int,
                   token_start: int, token_end: int) -> bytes:
    """request id, nonce (length-prefixed), sequence number (u64), layer, start, end (u32)."""
    return b"".join((_field(request_id.encode()), _field(nonce),
                     struct.pack("<QIII", sequence_number, layer, token_start, token_end)))


def chunk_checksum(payload_crc32c: int, metadata: bytes) -> int:
    """CRC-32C of k || v || metadata, given CRC-32C(k || v)."""
    return google_crc32c.extend(payload_crc32c, metadata)


def commit_checksum(request_id: str, nonce: bytes, token_count: int, chunk_count: int,
                    first_token_id: int, status: int, cached_tokens: int = 0) -> int:
    """CRC-32C of request id, nonce (length-prefixed), token count (u32), chunk count (u64),
    first token (u32), status (u32), then (1.2) cached tokens (u32) only when it is not 0: a
    commit without it has its 1.1 checksum, so a 1.1 peer's commits stay valid."""
    cached = struct.pack("<I", cached_tokens) if cached_tokens else b""
    return google_crc32c.value(b"".join((
        _field(request_id.encode()), _field(nonce),
        struct.pack("<IQII", token_count, chunk_count, first_token_id, status), cached)))
