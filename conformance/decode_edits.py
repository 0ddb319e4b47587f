"""Building blocks of the decode cases: each takes what the fake knows (`ScriptInput`) and
returns a script that differs from a well-formed handoff in exactly one way."""

from __future__ import annotations

from common.pb.kvhandoff.v1 import common_pb2, handoff_pb2
from conformance.decode_script import ScriptInput, Sleep, Step, middle
from conformance.handoff_edit import Frame, renumber
from conformance.wire import unknown_field

REJECTED = handoff_pb2.HANDOFF_STATUS_REJECTED


def rejected_header(i: ScriptInput, code: str, then: list[Step]) -> list[Step]:
    h = i.ref.header_with(status=REJECTED, reason="scripted rejection", reason_code=code)
    h.header.ClearField("layout")
    return [h, *then]


def replace_frame(frames: list[Step], index: int, frame: Frame) -> list[Step]:
    return frames[:index] + [frame] + frames[index + 1:]


def edit_chunk(i: ScriptInput, **fields) -> list[Step]:
    """The good handoff with one middle chunk's fields changed (crc recomputed unless given)."""
    frames = i.good()
    at = middle(frames)
    c = frames[at].chunk
    base = dict(seq=c.sequence_number, layer=c.layer, start=c.token_start, end=c.token_end)
    return replace_frame(frames, at, i.ref.chunk(**{**base, **fields}))


def good_with_commit(i: ScriptInput, **fields) -> list[Step]:
    """The good handoff with commit fields changed (chunk_count right unless given)."""
    good = i.good()
    return [*good[:-1], i.ref.commit_with(**{"chunk_count": len(good) - 2, **fields})]


def with_unknown_fields(frame: Frame) -> Frame:
    """The frame with an unknown field in the frame and in its header/chunk/commit."""
    kind = frame.WhichOneof("frame")
    inner = getattr(frame, kind)
    inner = type(inner).FromString(inner.SerializeToString() + unknown_field(900, 7))
    outer = Frame()
    getattr(outer, kind).CopyFrom(inner)
    return Frame.FromString(outer.SerializeToString() + unknown_field(901, 3))


def placeholder_handoff(i: ScriptInput) -> list[Step]:
    one = [i.ref.chunk(layer, layer, 0, 1) for layer in range(i.ref.num_layers)]
    return [i.ref.header_with(token_count=1), *one,
            i.ref.commit_with(token_count=1, chunk_count=len(one))]


def handoff_of_length(i: ScriptInput, n: int) -> list[Step]:
    chunks = i.ref.chunks(i.ref.ranges(i.ref.tokens_per_chunk(i.max_chunk_bytes), n))
    return [i.ref.header_with(token_count=n), *chunks,
            i.ref.commit_with(token_count=n, chunk_count=len(chunks))]


def overlapping_chunk(i: ScriptInput) -> list[Step]:
    frames = i.good()
    first = frames[1].chunk
    extra = i.ref.chunk(0, first.layer, first.token_end - 1, first.token_end + 1)
    frames = renumber(frames[:2] + [extra] + frames[2:])
    return replace_frame(frames, len(frames) - 1, i.ref.commit_with(chunk_count=len(frames) - 2))


def last_chunk_shifted(i: ScriptInput) -> list[Step]:
    """The last chunk of a middle layer moved one token later, [s+1, n+1): its token s is left
    uncovered and the count of covered layer-tokens is unchanged, so only the range check of
    D-13 (end <= token_count) refuses it."""
    frames = i.good()
    n, layer = i.ref.token_count, i.ref.num_layers // 2
    at = max(j for j, f in enumerate(frames) if f.HasField("chunk") and f.chunk.layer == layer)
    c = frames[at].chunk
    return replace_frame(frames, at, i.ref.chunk(c.sequence_number, layer, c.token_start + 1,
                                                 n + 1, k=c.k, v=c.v))


def one_token_edges(i: ScriptInput) -> list[Step]:
    """Every layer cut as [0, 1), [1, n-1) (in pieces within the limit), [n-1, n): one-token
    chunks at both ends of the prompt."""
    n, per = i.ref.token_count, i.ref.tokens_per_chunk(i.max_chunk_bytes)
    cuts = [(0, 1), *((s, min(s + per, n - 1)) for s in range(1, n - 1, per)), (n - 1, n)]
    return i.good(i.ref.chunks([(layer, s, e) for layer in range(i.ref.num_layers)
                                for s, e in cuts]))


def refusal_then_silence(i: ScriptInput, seconds: float) -> list[Step]:
    """A header and chunks up to one with a wrong crc32c, then the stream stays open."""
    frames = i.good()
    at = middle(frames)
    bad = edit_chunk(i, crc=frames[at].chunk.crc32c ^ 1)
    return [*bad[:at + 1], Sleep(seconds)]


def drop_chunk(i: ScriptInput, renumbered: bool) -> list[Step]:
    frames = i.good()
    del frames[middle(frames)]
    frames = renumber(frames) if renumbered else frames
    return replace_frame(frames, len(frames) - 1, i.ref.commit_with(chunk_count=len(frames) - 2))


def duplicate_chunk(i: ScriptInput, renumbered: bool) -> list[Step]:
    frames = i.good()
    at = middle(frames)
    frames = frames[: at + 1] + [frames[at]] + frames[at + 1:]
    frames = renumber(frames) if renumbered else frames
    return replace_frame(frames, len(frames) - 1, i.ref.commit_with(chunk_count=len(frames) - 2))


def reordered_chunks(i: ScriptInput) -> list[Step]:
    per = i.ref.tokens_per_chunk(i.max_chunk_bytes)
    return i.good(renumber(i.ref.chunks(i.ref.ranges(per))[::-1]))


def flip_last_byte(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 0x5A])


def oversize_tokens(t) -> int:
    return t.oversize_prompt_tokens()


def over_max(i: ScriptInput) -> list[Step]:
    """One chunk whose K+V exceed max_chunk_bytes: layout-consistent when the prompt is long
    enough, else the first chunk padded past the limit (SPEC D-26: size is checked first)."""
    n, per = i.ref.token_count, i.ref.kv_bytes_per_token_per_layer
    need = i.max_chunk_bytes // per + 1
    if need <= n:
        return i.good(i.ref.chunks(i.ref.ranges(need)))
    good = i.good()
    c = good[1].chunk
    pad = bytes(i.max_chunk_bytes // 2 + 1)
    return replace_frame(good, 1, i.ref.chunk(0, c.layer, c.token_start, c.token_end,
                                               k=c.k + pad, v=c.v + pad))


def over_transport(i: ScriptInput) -> list[Step]:
    good = i.good()
    c = good[1].chunk
    pad = bytes(i.max_chunk_bytes // 2 + (1 << 20))
    return replace_frame(good, 1, i.ref.chunk(0, c.layer, c.token_start, c.token_end,
                                               k=c.k + pad, v=c.v + pad))


def with_layout(i: ScriptInput, **changes) -> list[Step]:
    layout = common_pb2.KvLayout()
    layout.CopyFrom(i.ref.header.layout)
    for name, value in changes.items():
        setattr(layout, name, value(layout) if callable(value) else value)
    return [i.ref.header_with(layout=layout), *i.good()[1:]]


def with_version(major: int, minor: int = 0):
    return lambda i: [i.ref.header_with(protocol_version=common_pb2.ProtocolVersion(
        major=major, minor=minor)), *i.good()[1:]]


def other_dtype(layout: common_pb2.KvLayout) -> int:
    return (common_pb2.KV_DTYPE_FLOAT16 if layout.dtype != common_pb2.KV_DTYPE_FLOAT16
            else common_pb2.KV_DTYPE_FLOAT32)


def middle_kv(i: ScriptInput) -> tuple[bytes, bytes]:
    c = i.good()[middle(i.good())].chunk
    return c.k, c.v


def middle_crc(i: ScriptInput) -> int:
    return i.good()[middle(i.good())].chunk.crc32c


def chunk_with_reference(i: ScriptInput) -> list[Step]:
    """The good (inline) handoff with one middle chunk also carrying a shared-memory reference
    (its bytes and checksums unchanged; the reference names a well-formed region name)."""
    frames = i.good()
    at = middle(frames)
    edited = Frame()
    edited.CopyFrom(frames[at])
    c = edited.chunk
    c.ref.region = "kvh-" + "0" * 32
    c.ref.k_offset, c.ref.v_offset, c.ref.length = 0, len(c.k), len(c.k)
    return replace_frame(frames, at, edited)
