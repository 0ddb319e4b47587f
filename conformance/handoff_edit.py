"""A reference handoff taken apart, so that cases can put it back together differently: the
header, the commit and every layer's whole K and V bytes, plus builders for new frames.

Built only from what was on the wire (never from a model), so the fake prefill can serve any
well-formed or deliberately broken variant of a real handoff.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.handoff.layout import k_bytes_per_token_per_layer, kv_bytes_per_token_per_layer
from common.pb.kvhandoff.v1 import handoff_pb2
from conformance.binding import chunk_crc, commit_crc
from conformance.spec import DEFAULT_MAX_CHUNK_BYTES
from conformance.wire import crc32c

Frame = handoff_pb2.PrefillResponse


def header(h: handoff_pb2.HandoffHeader) -> Frame:
    return Frame(header=h)


def commit(c: handoff_pb2.HandoffCommit) -> Frame:
    return Frame(commit=c)


def chunk(request_id: str, seq: int, layer: int, start: int, end: int, k: bytes, v: bytes,
          crc: int | None = None, nonce: bytes = b"", chunk_crc32c: int | None = None) -> Frame:
    """A chunk frame; crc and chunk_crc32c default to the right checksums of what it carries."""
    c = handoff_pb2.KvChunk(
        request_id=request_id, sequence_number=seq, layer=layer, token_start=start,
        token_end=end, k=k, v=v, crc32c=crc32c(k, v) if crc is None else crc, nonce=nonce)
    c.chunk_crc32c = chunk_crc(c) if chunk_crc32c is None else chunk_crc32c
    return Frame(chunk=c)


def resealed(frame: Frame) -> Frame:
    """The frame with its 1.1 checksum recomputed over what it now carries (a tamperer who
    recomputes checksums: only the content checks can catch what it changed)."""
    out = Frame()
    out.CopyFrom(frame)
    if out.HasField("chunk"):
        out.chunk.crc32c = crc32c(out.chunk.k, out.chunk.v)
        out.chunk.chunk_crc32c = chunk_crc(out.chunk)
    elif out.HasField("commit"):
        out.commit.commit_crc32c = commit_crc(out.commit)
    return out


@dataclass
class Handoff:
    """A complete, verified-looking handoff from the reference prefill."""

    original: list[Frame]
    header: handoff_pb2.HandoffHeader
    commit: handoff_pb2.HandoffCommit
    k: list[bytes]  # per layer: token_count * k_bytes_per_token_per_layer
    v: list[bytes]

    @classmethod
    def from_frames(cls, frames: list[Frame]) -> Handoff:
        """Raises ValueError unless frames are header, chunks covering everything, commit."""
        if not frames or not frames[0].HasField("header") or not frames[-1].HasField("commit"):
            raise ValueError("the reference handoff is not header ... commit")
        head, tail = frames[0].header, frames[-1].commit
        n, per = head.token_count, k_bytes_per_token_per_layer(head.layout)
        k = [bytearray(n * per) for _ in range(head.layout.num_layers)]
        v = [bytearray(n * per) for _ in range(head.layout.num_layers)]
        for f in frames[1:-1]:
            c = f.chunk
            k[c.layer][c.token_start * per:c.token_end * per] = c.k
            v[c.layer][c.token_start * per:c.token_end * per] = c.v
        return cls(frames, head, tail, [bytes(x) for x in k], [bytes(x) for x in v])

    @property
    def request_id(self) -> str:
        return self.header.request_id

    @property
    def token_count(self) -> int:
        return self.header.token_count

    @property
    def num_layers(self) -> int:
        return self.header.layout.num_layers

    @property
    def k_bytes_per_token_per_layer(self) -> int:
        return k_bytes_per_token_per_layer(self.header.layout)

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        return kv_bytes_per_token_per_layer(self.header.layout)

    def kv(self, layer: int, start: int, end: int) -> tuple[bytes, bytes]:
        """K and V bytes of tokens [start, end) of a layer; tokens past the prompt are zeros."""
        per, n = self.k_bytes_per_token_per_layer, self.token_count
        pad = bytes(max(0, end - max(start, n)) * per)
        lo, hi = min(start, n) * per, min(end, n) * per
        return self.k[layer][lo:hi] + pad, self.v[layer][lo:hi] + pad

    def chunk(self, seq: int, layer: int, start: int, end: int, **overrides) -> Frame:
        """A chunk of this handoff's KV, with its nonce; overrides (request_id, k, v, crc,
        nonce, chunk_crc32c) replace fields."""
        if "k" not in overrides or "v" not in overrides:
            k, v = self.kv(layer, start, end)
            overrides.setdefault("k", k)
            overrides.setdefault("v", v)
        overrides.setdefault("nonce", self.header.nonce)
        request_id = overrides.pop("request_id", self.request_id)
        return chunk(request_id, seq, layer, start, end, **overrides)

    def tokens_per_chunk(self, max_chunk_bytes: int, pieces: int = 3) -> int:
        """Splits each layer into about `pieces` chunks, within the negotiated maximum."""
        limit = max(1, (max_chunk_bytes or DEFAULT_MAX_CHUNK_BYTES)
                    // self.kv_bytes_per_token_per_layer)
        return max(1, min(limit, -(-self.token_count // pieces)))

    def ranges(self, per_chunk: int, token_count: int | None = None) -> list[tuple[int, int, int]]:
        """(layer, start, end) in layer-major order covering token_count tokens per layer."""
        n = self.token_count if token_count is None else token_count
        return [(layer, s, min(s + per_chunk, n))
                for layer in range(self.num_layers) for s in range(0, n, per_chunk)]

    def chunks(self, ranges: list[tuple[int, int, int]]) -> list[Frame]:
        return [self.chunk(seq, layer, s, e) for seq, (layer, s, e) in enumerate(ranges)]

    def header_with(self, **fields) -> Frame:
        h = handoff_pb2.HandoffHeader()
        h.CopyFrom(self.header)
        for name, value in fields.items():
            if name in ("layout", "protocol_version"):
                getattr(h, name).CopyFrom(value)
            else:
                setattr(h, name, value)
        return header(h)

    def commit_with(self, **fields) -> Frame:
        """The reference commit with fields changed; its checksum recomputed unless given."""
        c = handoff_pb2.HandoffCommit()
        c.CopyFrom(self.commit)
        for name, value in fields.items():
            setattr(c, name, value)
        if "commit_crc32c" not in fields:
            c.commit_crc32c = commit_crc(c)
        return commit(c)


def renumber(frames: list[Frame]) -> list[Frame]:
    """Sequence numbers 0, 1, 2, ... over the chunks, in order (chunk_crc32c recomputed)."""
    out, seq = [], 0
    for f in frames:
        if f.HasField("chunk"):
            g = Frame()
            g.CopyFrom(f)
            g.chunk.sequence_number = seq
            g.chunk.chunk_crc32c = chunk_crc(g.chunk)
            seq += 1
            f = g
        out.append(f)
    return out
