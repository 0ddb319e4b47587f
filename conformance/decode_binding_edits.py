"""Scripts for the protocol 1.1 decode cases: a handoff that is not bound to decode's request
(nonce, digest, checksums), and handoffs whose checksums are all right but whose KV content is
wrong (what a tampering prefill sends; only decode's content checks can refuse them)."""

from __future__ import annotations

import secrets

from common.pb.kvhandoff.v1 import common_pb2
from conformance.binding import digest_of
from conformance.decode_script import ScriptInput, Step, middle
from conformance.handoff_edit import Frame, Handoff, resealed

# bytes of one NaN / +Inf element, by wire dtype
NAN = {common_pb2.KV_DTYPE_FLOAT32: b"\x00\x00\xc0\x7f", common_pb2.KV_DTYPE_FLOAT16: b"\x00\x7e",
       common_pb2.KV_DTYPE_BFLOAT16: b"\xc0\x7f"}
INF = {common_pb2.KV_DTYPE_FLOAT32: b"\x00\x00\x80\x7f", common_pb2.KV_DTYPE_FLOAT16: b"\x00\x7c",
       common_pb2.KV_DTYPE_BFLOAT16: b"\x80\x7f"}


def other_nonce() -> bytes:
    return secrets.token_bytes(16)


def with_header_nonce(i: ScriptInput, nonce: bytes) -> list[Step]:
    return [i.ref.header_with(nonce=nonce), *i.good()[1:]]


def with_digest(i: ScriptInput, digest: bytes) -> list[Step]:
    return [i.ref.header_with(prompt_digest=digest), *i.good()[1:]]


def digest_of_other_prompt(i: ScriptInput) -> bytes:
    ids = list(i.request.token_ids)
    return digest_of([(ids[0] + 1) % i.vocab_size, *ids[1:]])


def middle_chunk_nonce(i: ScriptInput) -> list[Step]:
    """One middle chunk carries another handoff's nonce (its checksum made with that nonce)."""
    frames = i.good()
    at = middle(frames)
    c = frames[at].chunk
    frames[at] = i.ref.chunk(c.sequence_number, c.layer, c.token_start, c.token_end,
                             nonce=other_nonce())
    return frames


def replay_with_nonce(i: ScriptInput) -> list[Step]:
    """Every frame of the handoff carries another handoff's nonce, checksums consistent with it:
    what a replay of an earlier handoff, ids rewritten, looks like."""
    nonce = other_nonce()
    out: list[Step] = []
    for f in i.good():
        g = Frame()
        g.CopyFrom(f)
        getattr(g, g.WhichOneof("frame")).nonce = nonce
        out.append(resealed(g))
    return out


def chunk_checksum_off(i: ScriptInput) -> list[Step]:
    frames = i.good()
    at = middle(frames)
    c = frames[at].chunk
    frames[at] = i.ref.chunk(c.sequence_number, c.layer, c.token_start, c.token_end,
                             chunk_crc32c=c.chunk_crc32c ^ 1)
    return frames


def swapped_chunk_labels(i: ScriptInput) -> list[Step]:
    """The first chunks of layers 0 and 1 trade their layer numbers; checksums not recomputed:
    the 1.0 crc (payload only) still matches, the 1.1 chunk checksum does not."""
    frames = i.good()
    at = {f.chunk.layer: n for n, f in enumerate(frames)
          if isinstance(f, Frame) and f.HasField("chunk") and f.chunk.token_start == 0}
    a, b = at[0], at[1]
    for index, layer in ((a, 1), (b, 0)):
        g = Frame()
        g.CopyFrom(frames[index])
        g.chunk.layer = layer
        frames[index] = g
    return frames


def commit_checksum_off(i: ScriptInput) -> list[Step]:
    good = i.good()
    c = i.ref.commit_with(chunk_count=len(good) - 2)
    return [*good[:-1], i.ref.commit_with(chunk_count=len(good) - 2,
                                          commit_crc32c=c.commit.commit_crc32c ^ 1)]


def forged_first_token(i: ScriptInput, sealed: bool) -> list[Step]:
    """The commit names another in-vocabulary first token; its checksum recomputed or not."""
    good = i.good()
    forged = (i.ref.commit.first_token_id + 1) % i.vocab_size
    fields = {"chunk_count": len(good) - 2, "first_token_id": forged}
    if not sealed:
        fields["commit_crc32c"] = i.ref.commit_with(chunk_count=len(good) - 2).commit.commit_crc32c
    return [*good[:-1], i.ref.commit_with(**fields)]


def with_minor(i: ScriptInput, minor: int) -> list[Step]:
    return [i.ref.header_with(protocol_version=common_pb2.ProtocolVersion(major=1, minor=minor)),
            *i.good()[1:]]


# ---- content: every checksum right, the KV wrong ----------------------------------------------
def _with_layers(i: ScriptInput, k: list[bytes], v: list[bytes]) -> list[Step]:
    """A well-formed, sealed handoff of decode's request carrying the given per-layer KV."""
    fake = Handoff(i.ref.original, i.ref.header, i.ref.commit, k, v)
    per = fake.tokens_per_chunk(i.max_chunk_bytes)
    return i.good(fake.chunks(fake.ranges(per)))


def poisoned_value(i: ScriptInput, table: dict[int, bytes]) -> list[Step]:
    """One value in the middle of a middle layer set to NaN or Inf."""
    layer = i.ref.num_layers // 2
    value = table[i.ref.header.layout.dtype]
    k = list(i.ref.k)
    at = (len(k[layer]) // 2) // len(value) * len(value)
    k[layer] = k[layer][:at] + value + k[layer][at + len(value):]
    return _with_layers(i, k, list(i.ref.v))


def zeroed_layer(i: ScriptInput, layer: int, halves: str = "kv") -> list[Step]:
    """A layer's K, V or both ("k", "v", "kv") all zeros, the rest genuine."""
    k, v = list(i.ref.k), list(i.ref.v)
    layer = layer % i.ref.num_layers
    if "k" in halves:
        k[layer] = bytes(len(k[layer]))
    if "v" in halves:
        v[layer] = bytes(len(v[layer]))
    return _with_layers(i, k, v)


def swapped_layers(i: ScriptInput, a: int, b: int) -> list[Step]:
    k, v = list(i.ref.k), list(i.ref.v)
    k[a], k[b], v[a], v[b] = k[b], k[a], v[b], v[a]
    return _with_layers(i, k, v)


def decoy_kv(i: ScriptInput, layers: range | None = None) -> list[Step]:
    """The KV of the decoy prompt (same length) in the given layers (all by default), passed
    off as decode's prompt's: ids, nonce, digest and checksums all right."""
    if i.decoy is None:
        raise ValueError("the case needs a decoy handoff")
    chosen = range(i.ref.num_layers) if layers is None else layers
    k = [i.decoy.k[n] if n in chosen else i.ref.k[n] for n in range(i.ref.num_layers)]
    v = [i.decoy.v[n] if n in chosen else i.ref.v[n] for n in range(i.ref.num_layers)]
    return _with_layers(i, k, v)


def placeholder_padded(prompt: list[int], vocab_size: int) -> list[int]:
    """A 1-token placeholder padded to the prompt's length: the 2026 bug's next form."""
    return [0] * len(prompt)


def another_prompt(prompt: list[int], vocab_size: int) -> list[int]:
    """Another tenant's prompt of the same length."""
    return [(t * 7 + 3) % vocab_size for t in prompt]


def middle_layer_range_stale(i: ScriptInput) -> list[Step]:
    """A middle layer's second half holds the decoy's KV for that range (stale pages)."""
    if i.decoy is None:
        raise ValueError("the case needs a decoy handoff")
    layer, per = i.ref.num_layers // 2, i.ref.k_bytes_per_token_per_layer
    half = (i.ref.token_count // 2) * per
    k, v = list(i.ref.k), list(i.ref.v)
    k[layer] = k[layer][:half] + i.decoy.k[layer][half:]
    v[layer] = v[layer][:half] + i.decoy.v[layer][half:]
    return _with_layers(i, k, v)




ELEMENT_BYTES = {common_pb2.KV_DTYPE_FLOAT32: 4, common_pb2.KV_DTYPE_FLOAT16: 2,
                 common_pb2.KV_DTYPE_BFLOAT16: 2}


def _negated(data: bytes, element: int) -> bytes:
    """Every little-endian float of data with its sign flipped."""
    out = bytearray(data)
    out[element - 1::element] = bytes(b ^ 0x80 for b in out[element - 1::element])
    return bytes(out)


def one_token_negated(i: ScriptInput) -> list[Step]:
    """K and V of one token in the middle of a middle layer negated (not the last position)."""
    layer, per = i.ref.num_layers // 2, i.ref.k_bytes_per_token_per_layer
    at = (i.ref.token_count // 2) * per
    element = ELEMENT_BYTES[i.ref.header.layout.dtype]
    k, v = list(i.ref.k), list(i.ref.v)
    k[layer] = k[layer][:at] + _negated(k[layer][at:at + per], element) + k[layer][at + per:]
    v[layer] = v[layer][:at] + _negated(v[layer][at:at + per], element) + v[layer][at + per:]
    return _with_layers(i, k, v)


def chunk_moved_from_layer_below(i: ScriptInput) -> list[Step]:
    """A middle layer's middle third holds the layer below's KV for that range: a chunk moved
    to another layer, relabelled and resealed (coverage stays exact)."""
    layer, per, n = i.ref.num_layers // 2, i.ref.k_bytes_per_token_per_layer, i.ref.token_count
    lo, hi = (n // 3) * per, (2 * n // 3) * per
    k, v = list(i.ref.k), list(i.ref.v)
    k[layer] = k[layer][:lo] + i.ref.k[layer - 1][lo:hi] + k[layer][hi:]
    v[layer] = v[layer][:lo] + i.ref.v[layer - 1][lo:hi] + v[layer][hi:]
    return _with_layers(i, k, v)


def as_protocol_1_0(i: ScriptInput) -> list[Step]:
    """The handoff as a 1.0 prefill sends it: header minor 0, no nonce, digest or checksums."""
    out: list[Step] = []
    for f in i.good():
        g = Frame()
        g.CopyFrom(f)
        inner = getattr(g, g.WhichOneof("frame"))
        inner.ClearField("nonce")
        for name in ("prompt_digest", "chunk_crc32c", "commit_crc32c"):
            if name in inner.DESCRIPTOR.fields_by_name:
                inner.ClearField(name)
        if g.HasField("header"):
            g.header.protocol_version.minor = 0
        out.append(g)
    return out
