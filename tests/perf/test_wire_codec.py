"""The handoff's fast wire path is protocol v1 byte for byte: what it writes is what the
generated stubs' SerializeToString writes, what it reads is what FromString reads, and the
payload is not copied on decode."""

from __future__ import annotations

import random

import google_crc32c
import numpy as np
import pytest
import torch
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.handoff.codec import (WireChunkFrame, bytes_to_kv, chunk_frame, chunk_wire,
                                  decode_frame, encode_chunk, parse_chunk_fast)
from common.handoff.layout import KvLayout
from common.pb.kvhandoff.v1 import handoff_pb2

U32 = st.integers(0, 2**32 - 1)
FIELDS = ("request_id", "sequence_number", "layer", "token_start", "token_end", "k", "v",
          "crc32c")


def _message(request_id, seq, layer, start, end, k, v, crc) -> handoff_pb2.PrefillResponse:
    return handoff_pb2.PrefillResponse(chunk=handoff_pb2.KvChunk(
        request_id=request_id, sequence_number=seq, layer=layer, token_start=start,
        token_end=end, k=k, v=v, crc32c=crc))


def _fields(chunk) -> tuple:
    return tuple(bytes(getattr(chunk, f)) if f in ("k", "v") else getattr(chunk, f)
                 for f in FIELDS)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request_id=st.text(max_size=40), seq=st.integers(0, 2**64 - 1), layer=U32, start=U32,
       end=U32, k=st.binary(max_size=300), v=st.binary(max_size=300), crc=U32)
def test_encode_equals_serialize_to_string(request_id, seq, layer, start, end, k, v, crc):
    expected = _message(request_id, seq, layer, start, end, k, v, crc).SerializeToString()
    wire = encode_chunk(request_id, seq, layer, start, end, k, v, crc)
    assert wire == expected
    parsed = decode_frame(wire)
    assert parsed.WhichOneof("frame") == "chunk"
    assert _fields(parsed.chunk) == (request_id, seq, layer, start, end, k, v, crc)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 17, 256])
def test_chunk_wire_equals_message_path(dtype, tokens):
    kv = torch.randn(2, tokens, 2, 64).to(dtype)
    wire = chunk_wire("req-7", 3, 1, 40, kv)
    assert wire == chunk_frame("req-7", 3, 1, 40, kv).SerializeToString()
    chunk = handoff_pb2.PrefillResponse.FromString(wire).chunk
    assert chunk.crc32c == google_crc32c.extend(google_crc32c.value(chunk.k), chunk.v)


def _mutations(data: bytes, rng: random.Random) -> list[bytes]:
    out = [data[:cut] for cut in sorted(rng.sample(range(len(data)), min(6, len(data))))]
    for _ in range(40):
        b = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        out.append(bytes(b))
    for _ in range(10):
        at = rng.randrange(len(data) + 1)
        out.append(data[:at] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
                   + data[at:])
    return out


def test_decode_agrees_with_from_string_on_mutated_frames():
    """Whatever the bytes, decode_frame and FromString accept the same and read the same."""
    rng = random.Random(1234)
    frames = [encode_chunk("r", 0, 0, 0, 1, b"\x01" * 8, b"\x02" * 8, 77),
              encode_chunk("ré-ü", 2**40, 7, 300, 302, bytes(range(16)), bytes(16), 2**32 - 1),
              _message("x", 1, 2, 3, 4, b"", b"v", 0).SerializeToString(),
              handoff_pb2.PrefillResponse(commit=handoff_pb2.HandoffCommit(
                  request_id="r", token_count=5, chunk_count=2)).SerializeToString()]
    cases = [m for frame in frames for m in _mutations(frame, rng)]
    fast_taken = 0
    for data in cases:
        try:
            expected = handoff_pb2.PrefillResponse.FromString(data)
        except DecodeError:
            with pytest.raises(DecodeError):
                decode_frame(data)
            continue
        got = decode_frame(data)
        fast_taken += isinstance(got, WireChunkFrame)
        assert got.WhichOneof("frame") == expected.WhichOneof("frame"), data
        if expected.WhichOneof("frame") == "chunk":
            assert _fields(got.chunk) == _fields(expected.chunk), data
    assert fast_taken > 0  # the mutations reached the fast path, not only the fallback


def test_fast_path_declines_what_is_not_canonical():
    canonical = encode_chunk("r", 1, 2, 3, 4, b"kk", b"vv", 5)
    assert parse_chunk_fast(canonical) is not None
    unknown_field = canonical[:1] + bytes([canonical[1] + 2]) + canonical[2:] + b"\x48\x01"
    reordered = b"\x12\x06" + b"\x18\x02" + b"\x10\x01" + b"\x28\x04"
    twice = canonical + canonical  # two chunk fields: protobuf merges them
    for data in (unknown_field, reordered, twice):
        assert parse_chunk_fast(data) is None
        assert decode_frame(data).WhichOneof("frame") == "chunk"  # protobuf still reads it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 100, 1024])
def test_chunk_views_become_the_sent_tensor(dtype, tokens):
    """The parsed chunk's K and V are views into the received frame (no copy while parsing);
    bytes_to_kv makes the one contiguous tensor the pool write takes, equal to what was sent."""
    layout = KvLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=dtype)
    kv = torch.randn(2, tokens, 2, 64).to(dtype)
    wire = chunk_wire("req", 0, 1, 0, kv)
    chunk = decode_frame(wire).chunk
    frame_start = np.frombuffer(wire, dtype=np.uint8).__array_interface__["data"][0]
    for view in (chunk.k, chunk.v):
        assert frame_start <= view.__array_interface__["data"][0] < frame_start + len(wire)
        assert not view.flags.writeable
    out = bytes_to_kv(layout, chunk.k, chunk.v, tokens)
    assert out.is_contiguous() and torch.equal(out, kv)
    assert torch.equal(bytes_to_kv(layout, bytes(chunk.k), bytes(chunk.v), tokens), kv)
