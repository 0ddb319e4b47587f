"""Random corruptions of a serialized handoff (a list of frames as bytes), and the spec's own
verdict on the result: is it still a well-formed handoff of the request?

The verdict comes from the conformance suite's frame checker (SPEC.md P-01..P-07), not from
decode: a corruption that leaves the stream byte-identical, or changes only what the protocol
does not protect (a reason text, a minor version, an in-vocabulary first token, two chunks'
metadata swapped), is still a valid handoff, and decode must serve it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from google.protobuf.message import DecodeError
from hypothesis import strategies as st

from common.pb.kvhandoff.v1 import common_pb2, handoff_pb2
from conformance.handoff_edit import resealed
from conformance.prefill_checks import check_handoff
from conformance.wire import Received

KINDS = ("flip_byte", "set_field", "drop", "duplicate", "swap", "truncate", "insert_empty",
         "reseal_value")
# reseal_value changes one K or V value where decode's content checks see every value (layer 0,
# or the last prompt position in any layer) by at least one rms of its layer, or makes it NaN,
# then recomputes every checksum: a well-formed handoff whose content is wrong.
FIELDS = {
    "header": ("request_id", "token_count", "status", "model_fingerprint", "reason",
               "reason_code", "protocol_version.major", "protocol_version.minor",
               "layout.num_layers", "layout.num_kv_heads", "layout.head_dim", "layout.dtype",
               "nonce", "prompt_digest"),
    "chunk": ("request_id", "sequence_number", "layer", "token_start", "token_end", "k", "v",
              "crc32c", "nonce", "chunk_crc32c"),
    "commit": ("request_id", "token_count", "chunk_count", "first_token_id", "status", "reason",
               "nonce", "commit_crc32c"),
}
ENUM_RANGE = {"status": 8, "layout.dtype": 5}
NUMPY_DTYPES = {common_pb2.KV_DTYPE_FLOAT32: np.float32, common_pb2.KV_DTYPE_FLOAT16: np.float16}


@dataclass(frozen=True)
class Corruption:
    kind: str
    where: int  # picks a frame (modulo the stream's length at the time)
    other: int  # a second pick: byte position, field, or second frame
    value: int  # new value, or xor mask

    def apply(self, frames: list[bytes]) -> list[bytes]:
        frames = list(frames)
        if not frames:
            return [b""] if self.kind == "insert_empty" else frames
        i = self.where % len(frames)
        if self.kind == "flip_byte" and frames[i]:
            data = bytearray(frames[i])
            data[self.other % len(data)] ^= self.value % 255 + 1
            frames[i] = bytes(data)
        elif self.kind == "set_field":
            frames[i] = _set_field(frames[i], self.other, self.value)
        elif self.kind == "drop":
            del frames[i]
        elif self.kind == "duplicate":
            frames.insert(i + 1, frames[i])
        elif self.kind == "swap":
            j = self.other % len(frames)
            frames[i], frames[j] = frames[j], frames[i]
        elif self.kind == "truncate":
            frames = frames[:i]
        elif self.kind == "insert_empty":
            frames.insert(self.where % (len(frames) + 1), b"")
        elif self.kind == "reseal_value":
            frames = _reseal_value(frames, self.where, self.other, self.value)
        return frames


def _parsed(data: bytes) -> handoff_pb2.PrefillResponse | None:
    try:
        return handoff_pb2.PrefillResponse.FromString(data)
    except DecodeError:
        return None


def _reseal_value(frames: list[bytes], where: int, other: int, value: int) -> list[bytes]:
    parsed = [_parsed(f) for f in frames]
    header = next((f.header for f in parsed if f is not None and f.HasField("header")), None)
    if header is None or header.layout.dtype not in NUMPY_DTYPES:
        return frames
    n, dtype = header.token_count, NUMPY_DTYPES[header.layout.dtype]
    per_token = header.layout.num_kv_heads * header.layout.head_dim
    targets = [i for i, f in enumerate(parsed) if f is not None and f.HasField("chunk")
               and (f.chunk.layer == 0 or f.chunk.token_start < n <= f.chunk.token_end)]
    if not targets:
        return frames
    index = targets[where % len(targets)]
    c = parsed[index].chunk
    part = "k" if other % 2 else "v"
    data = getattr(c, part)
    if len(data) % np.dtype(dtype).itemsize:  # an earlier change cut it: nothing to reseal
        return frames
    values = np.frombuffer(data, dtype=dtype).copy()
    if values.size == 0:
        return frames
    last = (n - 1 - c.token_start) * per_token
    if c.layer == 0:  # any value of layer 0; else one of the last position's
        at = (other // 2) % values.size
    else:
        at = last + (other // 2) % per_token
    if at >= values.size:
        return frames
    rms = float(np.sqrt(np.mean(values.astype(np.float64) ** 2))) or 1.0
    values[at] = np.nan if value % 9 == 0 else values[at] + (1 + value % 8) * max(rms, 1.0)
    setattr(c, part, values.tobytes())
    frames = list(frames)
    frames[index] = resealed(parsed[index]).SerializeToString()
    return frames


def _set_field(data: bytes, pick: int, value: int) -> bytes:
    try:
        frame = handoff_pb2.PrefillResponse.FromString(data)
    except DecodeError:
        return data
    kind = frame.WhichOneof("frame")
    if kind is None:
        return data
    path = FIELDS[kind][pick % len(FIELDS[kind])]
    *parents, name = path.split(".")
    message = getattr(frame, kind)
    for parent in parents:
        message = getattr(message, parent)
    current = getattr(message, name)
    if isinstance(current, str):
        new = "" if value % 4 == 0 else f"{current}{value}"[-40:]
    elif isinstance(current, bytes):
        new = current[: value % (len(current) + 1)]
    else:
        new = value % ENUM_RANGE.get(path, 1 << 32)
    setattr(message, name, new)
    return frame.SerializeToString()


corruptions = st.lists(
    st.builds(Corruption, kind=st.sampled_from(KINDS), where=st.integers(0, 1000),
              other=st.integers(0, 1 << 20),
              value=st.one_of(st.integers(0, 64), st.integers(0, (1 << 32) - 1))),
    min_size=1, max_size=3)


def still_valid(request: handoff_pb2.PrefillRequest, info: handoff_pb2.GetPrefillInfoResponse,
                frames: list[bytes]) -> bool:
    """True when the frames are a well-formed handoff of the request by the spec's rules."""
    parsed: list[handoff_pb2.PrefillResponse | None] = []
    for data in frames:
        try:
            parsed.append(handoff_pb2.PrefillResponse.FromString(data))
        except DecodeError:
            parsed.append(None)
    return not check_handoff(request, info, Received(parsed))
