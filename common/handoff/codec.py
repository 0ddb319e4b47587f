"""Handoff frames: built on prefill, parsed on decode, and chunk bytes turned back into tensors.

Two paths produce the same bytes. The message path (`header_frame`, `chunk_frame`,
`commit_frame`) builds protobuf objects. The wire path (`encode_chunk`, `chunk_wire`,
`frame_wire`, `decode_frame`) writes and reads the protobuf encoding of a `PrefillResponse`
directly, so that a chunk's payload is copied exactly once into the frame on prefill and not at
all while decode parses and verifies it (one copy then makes the tensor the pool write
takes). Invariants:
- `encode_chunk(...)` == `PrefillResponse(chunk=KvChunk(...)).SerializeToString()`, byte for byte
  (fields in field-number order, proto3 defaults omitted);
- `decode_frame(data)` accepts exactly what `PrefillResponse.FromString(data)` accepts and yields
  the same field values; anything its fast path does not recognise goes to `FromString`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from common.handoff.crc import payload_crc32c
from common.handoff.binding import chunk_checksum, chunk_metadata, commit_checksum
from common.handoff.layout import KvLayout, protocol_version
from common.handoff.page_pieces import KvPieces
from common.handoff.scattered import ScatteredBytes
from common.pb.kvhandoff.v1 import handoff_pb2

_CHUNK_FIELD_TAG = 0x12  # PrefillResponse.chunk: field 2, length-delimited
_U32 = 1 << 32
_U64 = 1 << 64


# ---- message path --------------------------------------------------------------------------
def tensor_bytes(t: torch.Tensor) -> bytes:
    """Little-endian raw bytes of a CPU tensor (bf16 included)."""
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def header_frame(request_id: str, token_count: int, status: int, layout: KvLayout | None,
                 fingerprint: str, reason: str = "", reason_code: str = "", nonce: bytes = b"",
                 digest: bytes = b"") -> handoff_pb2.PrefillResponse:
    """digest: `binding.prompt_digest` of the ids prefill computes; empty for a rejection."""
    header = handoff_pb2.HandoffHeader(
        protocol_version=protocol_version(), request_id=request_id, token_count=token_count,
        status=status, reason=reason, reason_code=reason_code, model_fingerprint=fingerprint,
        nonce=nonce, prompt_digest=digest)
    if layout is not None:
        header.layout.CopyFrom(layout.to_proto())
    return handoff_pb2.PrefillResponse(header=header)


def chunk_frame(request_id: str, sequence_number: int, layer: int, token_start: int,
                kv: torch.Tensor, nonce: bytes = b"") -> handoff_pb2.PrefillResponse:
    """kv: [2, n, Hkv, D] on the CPU; both checksums set."""
    k, v = tensor_bytes(kv[0]), tensor_bytes(kv[1])
    token_end = token_start + kv.shape[1]
    crc = payload_crc32c(k, v)
    meta = chunk_metadata(request_id, nonce, sequence_number, layer, token_start, token_end)
    chunk = handoff_pb2.KvChunk(
        request_id=request_id, sequence_number=sequence_number, layer=layer,
        token_start=token_start, token_end=token_end, k=k, v=v, crc32c=crc, nonce=nonce,
        chunk_crc32c=chunk_checksum(crc, meta))
    return handoff_pb2.PrefillResponse(chunk=chunk)


def commit_frame(request_id: str, token_count: int, chunk_count: int, first_token_id: int,
                 status: int = handoff_pb2.HANDOFF_STATUS_OK, reason: str = "",
                 nonce: bytes = b"", cached_tokens: int = 0) -> handoff_pb2.PrefillResponse:
    """The commit, its checksum set over the fields it covers (cached_tokens: 1.2, D-90)."""
    return handoff_pb2.PrefillResponse(commit=handoff_pb2.HandoffCommit(
        request_id=request_id, token_count=token_count, chunk_count=chunk_count,
        first_token_id=first_token_id, status=status, reason=reason, nonce=nonce,
        cached_tokens=cached_tokens,
        commit_crc32c=commit_checksum(request_id, nonce, token_count, chunk_count,
                                      first_token_id, status, cached_tokens)))


# ---- wire path: encoding -------------------------------------------------------------------
def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _scalar(tag: int, value: int) -> bytes:
    return bytes((tag,)) + _varint(value) if value else b""


def _bytes_field(tag: int, data: bytes) -> bytes:
    return bytes((tag,)) + _varint(len(data)) + data if data else b""


def encode_chunk(request_id: str, sequence_number: int, layer: int, token_start: int,
                 token_end: int, k, v, crc32c: int, nonce: bytes = b"",
                 chunk_crc32c: int = 0) -> bytes:
    """The serialized `PrefillResponse(chunk=KvChunk(...))`. k and v are C-contiguous byte
    buffers (bytes, uint8 numpy arrays) or ScatteredBytes (views of the pages); each is copied
    once, into the returned frame (one join, which drops the GIL for large frames)."""
    k_len, v_len = len(k), len(v)
    prefix = b"".join((
        _bytes_field(0x0a, request_id.encode()),
        _scalar(0x10, sequence_number), _scalar(0x18, layer), _scalar(0x20, token_start),
        _scalar(0x28, token_end), b"\x32" + _varint(k_len) if k_len else b""))
    middle = b"\x3a" + _varint(v_len) if v_len else b""
    suffix = _scalar(0x40, crc32c) + _bytes_field(0x4a, nonce) + _scalar(0x50, chunk_crc32c)
    body = len(prefix) + k_len + len(middle) + v_len + len(suffix)
    head = bytes((_CHUNK_FIELD_TAG,)) + _varint(body) + prefix
    return b"".join((head, *_parts(k), middle, *_parts(v), suffix))


def _parts(data) -> tuple:
    return data.pieces if isinstance(data, ScatteredBytes) else (data,)


def kv_buffers(kv: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """kv: [2, n, Hkv, D] on the CPU -> K and V as flat uint8 views (no copy when contiguous)."""
    flat = kv.contiguous().view(torch.uint8).numpy().reshape(2, -1)
    return flat[0], flat[1]


def chunk_payload(kv) -> tuple[object, object, int]:
    """What `KvSender.pack` returned (KvPieces in the pages, or a [2, n, Hkv, D] CPU tensor)
    -> (K bytes, V bytes, number of tokens), nothing copied for pieces or a contiguous tensor."""
    if isinstance(kv, KvPieces):
        return kv.k, kv.v, kv.num_tokens
    k, v = kv_buffers(kv)
    return k, v, kv.shape[1]


def chunk_wire(request_id: str, sequence_number: int, layer: int, token_start: int,
               kv, nonce: bytes = b"") -> bytes:
    """The serialized chunk frame of kv (chunk_payload's input), both checksums included; the
    payload is read once for the checksum and copied once, into the frame."""
    k, v, num_tokens = chunk_payload(kv)
    token_end = token_start + num_tokens
    crc = payload_crc32c(k, v)
    meta = chunk_metadata(request_id, nonce, sequence_number, layer, token_start, token_end)
    return encode_chunk(request_id, sequence_number, layer, token_start, token_end, k, v, crc,
                        nonce, chunk_checksum(crc, meta))


def frame_wire(frame: handoff_pb2.PrefillResponse) -> bytes:
    """Headers and commits are small: the message path serializes them."""
    return frame.SerializeToString()


# ---- wire path: decoding -------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class WireChunk:
    """A KvChunk read without copying its payload: k and v are read-only uint8 numpy views of
    the received frame, or decode's own copy of referenced bytes (ScatteredBytes when they
    landed in its pages); the verifier needs only len() and crc32c over them."""

    request_id: str
    sequence_number: int
    layer: int
    token_start: int
    token_end: int
    k: np.ndarray
    v: np.ndarray
    crc32c: int
    nonce: bytes = b""
    chunk_crc32c: int = 0


@dataclass(frozen=True, slots=True)
class WireChunkFrame:
    """Stands in for a `PrefillResponse` whose oneof `frame` is a chunk."""

    chunk: WireChunk

    def WhichOneof(self, oneof: str) -> str:  # noqa: N802 - the protobuf method's name
        if oneof != "frame":
            raise ValueError(f"PrefillResponse has no oneof {oneof!r}")
        return "chunk"

    def HasField(self, name: str) -> bool:  # noqa: N802
        return name == "chunk"


def _empty() -> np.ndarray:
    empty = np.empty(0, dtype=np.uint8)
    empty.flags.writeable = False
    return empty


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    """-> (value, next position); value -1 when the varint is truncated or over 10 bytes."""
    result = shift = 0
    for i in range(pos, min(pos + 10, len(data))):
        byte = data[i]
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, i + 1
        shift += 7
    return -1, pos


def parse_chunk_fast(data: bytes) -> WireChunkFrame | None:
    """A frame in the canonical encoding of a chunk, parsed in O(header) without copying the
    payload; None for anything else (then `PrefillResponse.FromString` decides)."""
    if len(data) < 2 or data[0] != _CHUNK_FIELD_TAG:
        return None
    body, pos = _read_varint(data, 1)
    if body < 0 or pos + body != len(data):
        return None
    values: dict[int, int] = {}
    spans: dict[int, tuple[int, int]] = {}
    last = 0
    end = len(data)
    while pos < end:
        tag, pos = _read_varint(data, pos)
        field, wire = tag >> 3, tag & 7
        if tag < 0 or field <= last or field > 10:
            return None  # unknown, repeated or out-of-order field: not the canonical form
        last = field
        if field in (1, 6, 7, 9):
            if wire != 2:
                return None
            size, pos = _read_varint(data, pos)
            if size < 0 or pos + size > end:
                return None
            spans[field] = (pos, pos + size)
            pos += size
        else:
            if wire != 0:
                return None
            value, pos = _read_varint(data, pos)
            if value < 0 or value >= (_U64 if field == 2 else _U32):
                return None
            values[field] = value
    try:
        start, stop = spans.get(1, (0, 0))
        request_id = data[start:stop].decode("utf-8")
    except UnicodeDecodeError:
        return None
    return WireChunkFrame(WireChunk(
        request_id=request_id, sequence_number=values.get(2, 0), layer=values.get(3, 0),
        token_start=values.get(4, 0), token_end=values.get(5, 0),
        k=_view(data, spans.get(6)), v=_view(data, spans.get(7)), crc32c=values.get(8, 0),
        nonce=bytes(data[slice(*spans.get(9, (0, 0)))]), chunk_crc32c=values.get(10, 0)))


def _view(data: bytes, span: tuple[int, int] | None) -> np.ndarray:
    if span is None or span[0] == span[1]:
        return _empty()
    return np.frombuffer(data, dtype=np.uint8, count=span[1] - span[0], offset=span[0])


def decode_frame(data: bytes) -> handoff_pb2.PrefillResponse | WireChunkFrame:
    """Parses one serialized PrefillResponse; raises google.protobuf DecodeError when protobuf
    would. Costs O(header) for a canonical chunk, whatever its payload size."""
    fast = parse_chunk_fast(data)
    if fast is not None:
        return fast
    return handoff_pb2.PrefillResponse.FromString(data)


# ---- chunk bytes to tensors ----------------------------------------------------------------
def bytes_to_kv(layout: KvLayout, k, v, num_tokens: int) -> torch.Tensor:
    """-> a new contiguous [2, num_tokens, Hkv, D] CPU tensor; the bytes were already
    size-checked. k and v (bytes, or the numpy views of a WireChunk) are copied once each: the
    one copy a contiguous transfer buffer needs, since K and V are not adjacent on the wire."""
    out = torch.empty((2, num_tokens, layout.num_kv_heads, layout.head_dim), dtype=layout.dtype)
    flat = out.view(torch.uint8).view(2, -1).numpy()
    flat[0] = np.frombuffer(k, dtype=np.uint8)
    flat[1] = np.frombuffer(v, dtype=np.uint8)
    return out
