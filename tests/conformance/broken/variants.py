"""Each variant monkeypatches one rule out of our prefill or decode. `apply(name)` must run
before the service starts (it patches classes, so instances made later are affected)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable


from common.handoff.codec import chunk_frame
from common.handoff.crc import payload_crc32c
from common.handoff.verifier import ABORTED, HandoffVerifier
from common.pb.kvhandoff.v1 import handoff_pb2
from tests.conformance.broken.blind_spots import BLIND_SPOT_VARIANTS


def _patch(cls: type, name: str, make: Callable) -> None:
    original = getattr(cls, name, None)
    if original is None:
        raise RuntimeError(f"{cls.__name__}.{name} no longer exists; update the broken variant")
    setattr(cls, name, make(original))


class _CrcOverride:
    """A chunk seen through a lens: crc32c replaced, every other attribute the chunk's own."""

    def __init__(self, chunk, crc: int) -> None:
        self._chunk = chunk
        self.crc32c = crc

    def __getattr__(self, name: str):
        return getattr(self._chunk, name)


# ---- decode ---------------------------------------------------------------------------------
def decode_accepts_aborted() -> None:
    """D-08 broken: a header or commit with status ABORTED is treated as OK."""
    _patch(HandoffVerifier, "_check_status", lambda original: (
        lambda self, name, status, reason, code:
        None if status == ABORTED else original(self, name, status, reason, code)))


def decode_trusts_token_count() -> None:
    """D-07 broken: decode believes the header's token count (the 2026 placeholder bug)."""
    def make(original):
        def _on_header(self, header):
            if 0 < header.token_count != self.expect.token_count:
                self.expect = dataclasses.replace(self.expect, token_count=header.token_count)
                self._coverage = [bytearray(header.token_count)
                                  for _ in range(self.expect.layout.num_layers)]
            return original(self, header)
        return _on_header
    _patch(HandoffVerifier, "_on_header", make)


def decode_skips_checksum() -> None:
    """D-17 broken: the crc32c is never compared (each chunk is checked with its true crc)."""
    def make(original):
        def _on_chunk(self, chunk):
            crc = payload_crc32c(chunk.k, chunk.v)  # inline or landed bytes alike
            return original(self, _CrcOverride(chunk, crc))
        return _on_chunk
    _patch(HandoffVerifier, "_on_chunk", make)


def decode_ignores_request_id() -> None:
    """D-05 broken: frames naming another request are accepted."""
    _patch(HandoffVerifier, "_check_request_id", lambda original: (
        lambda self, frame_name, request_id: None))


class _Lens:
    """A frame seen with some attributes replaced, every other attribute the frame's own."""

    def __init__(self, frame, **fields) -> None:
        self._frame = frame
        self.__dict__.update(fields)

    def __getattr__(self, name: str):
        return getattr(self._frame, name)


def decode_ignores_nonce() -> None:
    """D-41 broken: a frame's nonce is never compared."""
    _patch(HandoffVerifier, "_check_nonce", lambda original: (
        lambda self, frame_name, nonce: None))


def decode_ignores_digest() -> None:
    """D-42 broken: the header's prompt digest is taken to be right."""
    def make(original):
        def _check_header_binding(self, header):
            return original(self, _Lens(header, prompt_digest=self.expect.prompt_digest))
        return _check_header_binding
    _patch(HandoffVerifier, "_check_header_binding", make)


def decode_skips_frame_checksums() -> None:
    """D-43 broken: chunk and commit checksums are never compared (each frame is checked with
    the checksum of what it carries)."""
    from common.handoff.binding import chunk_checksum, chunk_metadata, commit_checksum

    def make_chunk(original):
        def _on_chunk(self, chunk):
            crc = payload_crc32c(chunk.k, chunk.v)  # inline or landed bytes alike
            meta = chunk_metadata(chunk.request_id, self.expect.nonce, chunk.sequence_number,
                                  chunk.layer, chunk.token_start, chunk.token_end)
            return original(self, _Lens(chunk, chunk_crc32c=chunk_checksum(crc, meta)))
        return _on_chunk

    def make_commit(original):
        def _on_commit(self, commit):
            crc = commit_checksum(commit.request_id, self.expect.nonce, commit.token_count,
                                  commit.chunk_count, commit.first_token_id, commit.status,
                                  commit.cached_tokens)
            return original(self, _Lens(commit, commit_crc32c=crc))
        return _on_commit
    _patch(HandoffVerifier, "_on_chunk", make_chunk)
    _patch(HandoffVerifier, "_on_commit", make_commit)


def decode_accepts_protocol_1_0() -> None:
    """D-44 broken: a 1.0 (unbound) handoff is accepted without the operator's flag."""
    def make(original):
        def _check_header_binding(self, header):
            self.expect = dataclasses.replace(self.expect, allow_protocol_1_0=True)
            return original(self, header)
        return _check_header_binding
    _patch(HandoffVerifier, "_check_header_binding", make)


def decode_ignores_reference_on_inline() -> None:
    """D-63 broken: an inline chunk that also carries a shared-memory reference is accepted."""
    import decode_svc.handoff as handoff

    _patch_module(handoff, "_inline_only", lambda original: (lambda frame: frame))


def decode_trusts_region_files() -> None:
    """D-62 broken: decode opens whatever a shared-memory reference names in its directory,
    following links, without looking at the name's form, the file's kind, owner or mode."""
    import os
    from pathlib import Path

    from common.handoff.shm_region import RegionError, RegionReader

    def make(original):
        def __init__(self, directory, name):  # noqa: N807 - the method it replaces
            path = Path(directory) / name
            try:
                self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as err:
                raise RegionError(f"region {name} cannot be opened: {err.strerror}") from err
            self.name, self.path = name, path
        return __init__
    _patch(RegionReader, "__init__", make)


def decode_trusts_cached_tokens() -> None:
    """D-90 broken: a 1.2 commit's cached_tokens is taken as it comes, never bounded."""
    _patch(HandoffVerifier, "_cached_tokens", lambda original: (
        lambda self, cached: cached))


def decode_skips_finite_check() -> None:
    """D-45 broken: non-finite KV values are not looked for."""
    import decode_svc.engine as engine

    _patch_module(engine, "refusal_if_not_finite", lambda original: (
        lambda tracker, request_id: None))


def decode_skips_layer0_check() -> None:
    """D-46 broken: layer 0 is not recomputed (its error reads as 0)."""
    import decode_svc.content_check as content

    _patch_module(content, "_layer0_error", lambda original: (
        lambda model, pool, table, ids: 0.0))


def decode_skips_depth_check() -> None:
    """D-47 broken: the depth step runs (for the first token) but its K/V are not compared."""
    import decode_svc.content_check as content

    def make(original):
        def _depth_compare(sent, mine):
            _, layer = original(sent, mine)
            return 0.0, layer
        return _depth_compare
    _patch_module(content, "_depth_compare", make)


def decode_streams_prefill_first_token() -> None:
    """D-48 broken: the checks run, but the commit's first_token_id is streamed."""
    import dataclasses

    from decode_svc.content_gate import ContentGate

    def make(original):
        async def check(self, landed, *args):
            checked = await original(self, landed, *args)
            return dataclasses.replace(checked, first_token=landed.advisory_first_token)
        return check
    _patch(ContentGate, "check", make)


def _patch_module(module, name: str, make: Callable) -> None:
    original = getattr(module, name, None)
    if original is None:
        raise RuntimeError(f"{module.__name__}.{name} no longer exists; update the variant")
    setattr(module, name, make(original))
def decode_truncates_long_prompt() -> None:
    """D-28 broken: a prompt over the limits is cut to its last tokens and served."""
    from decode_svc import lifecycle  # the request path both front doors share

    def make(original):
        def validate_generate(ids, request, limits):
            keep = min(limits.context_window - 1, limits.prefill_max_prompt)
            return original(ids[-keep:], request, limits)
        return validate_generate
    _patch(lifecycle, "validate_generate", make)


def decode_passes_salt_as_scope() -> None:
    """D-80 broken: the client's cache_salt is sent as the cache_scope, as it came (a client
    that knows or guesses another tenant's salt shares its cache)."""
    from decode_svc import lifecycle  # the request path both front doors share

    _patch(lifecycle, "cache_scope", lambda original: (
        lambda identity, salt: salt.encode()))


def decode_forwards_prompt_head() -> None:
    """D-03 broken: a valid prompt longer than 64 tokens is forwarded (and served) as its first
    64 tokens; the handoff it gets back is consistent with what it sent."""
    from decode_svc import lifecycle  # the request path both front doors share
    from decode_svc.validation import ValidPrompt

    def make(original):
        def validate_generate(ids, request, limits):
            prompt = original(ids, request, limits)
            return ValidPrompt(prompt.token_ids[:64], prompt.max_tokens)
        return validate_generate
    _patch(lifecycle, "validate_generate", make)


def decode_accepts_empty_fingerprint() -> None:
    """D-09 broken: a header without a model fingerprint is read as naming decode's model."""
    def make(original):
        def _on_header(self, header):
            if not header.model_fingerprint:
                filled = handoff_pb2.HandoffHeader()
                filled.CopyFrom(header)
                filled.model_fingerprint = self.expect.model_fingerprint
                header = filled
            return original(self, header)
        return _on_header
    _patch(HandoffVerifier, "_on_header", make)


LATE_CANCEL_S = 3.0


def decode_cancels_late() -> None:
    """D-29 broken: the prefill call is cancelled 3 s after decode is done with it (a cleanup
    timer), so a prefill that keeps streaming keeps working for 3 s after the refusal."""
    from decode_svc.prefill_client import HandoffStream

    def make(original):
        def cancel(self):
            asyncio.get_running_loop().call_later(LATE_CANCEL_S, original, self)
            return True
        return cancel
    _patch(HandoffStream, "cancel", make)


def decode_range_end_off_by_one() -> None:
    """D-13 broken: a chunk may end at token_count + 1 (`end <= token_count + 1`)."""
    def make(original):
        def _on_chunk(self, chunk):
            expect = self.expect
            self.expect = dataclasses.replace(expect, token_count=expect.token_count + 1)
            try:
                return original(self, chunk)
            finally:
                self.expect = expect
        return _on_chunk
    _patch(HandoffVerifier, "_on_chunk", make)


def decode_refuses_one_token_chunks() -> None:
    """D-13 broken at the other end: `start + 1 < end`, so a chunk of one token is refused."""
    def make(original):
        def _on_chunk(self, chunk):
            if chunk.token_end == chunk.token_start + 1:
                raise self._fail("CHUNK_RANGE_INVALID", "a one-token chunk")
            return original(self, chunk)
        return _on_chunk
    _patch(HandoffVerifier, "_on_chunk", make)


# ---- prefill --------------------------------------------------------------------------------
def _servicer():
    from prefill_svc.servicer import HandoffServicer

    return HandoffServicer


def prefill_chunks_after_rejected() -> None:
    """P-09/P-12 broken: a rejection's header is followed by a (zero) chunk."""
    from prefill_svc.validation import validate_prefill

    def make(original):
        async def Prefill(self, request, context):  # noqa: N802 - the servicer method's name
            rejected = validate_prefill(request, self.limits) is not None
            first = True
            async for frame in original(self, request, context):
                yield frame
                if rejected and first:
                    import torch

                    layout = self.layout
                    kv = torch.zeros(2, 1, layout.num_kv_heads, layout.head_dim,
                                     dtype=layout.dtype)
                    chunk = chunk_frame(request.request_id, 0, 0, 0, kv)
                    yield chunk.SerializeToString() if isinstance(frame, bytes) else chunk
                first = False
        return Prefill
    _patch(_servicer(), "Prefill", make)


def prefill_placeholder_over_length() -> None:
    """P-08/P-12 broken: a prompt over the window is served as its first token."""
    def make(original):
        async def Prefill(self, request, context):  # noqa: N802
            if len(request.token_ids) > self.limits.context_window:
                short = handoff_pb2.PrefillRequest()
                short.CopyFrom(request)
                del short.token_ids[1:]
                request = short
            async for frame in original(self, request, context):
                yield frame
        return Prefill
    _patch(_servicer(), "Prefill", make)


def prefill_cache_keyed_by_position() -> None:
    """P-81 broken: the prefix cache keys a page on its scope and index only, not on the
    tokens before and in it, so a prompt sharing only the first page borrows the other pages
    of another prompt."""
    import hashlib

    from prefill_svc import prefix_cache

    def page_keys(scope, token_ids, page_size):
        return [hashlib.sha256(scope + i.to_bytes(4, "big")).digest()
                for i in range(len(token_ids) // page_size)]

    prefix_cache.page_keys = page_keys
    _patch(prefix_cache.PrefixCache, "_matches", lambda original: staticmethod(
        lambda entry, scope, parent, tokens: entry.scope == scope))


def prefill_drops_a_chunk() -> None:
    """P-05 broken: the last chunk of layer 0 is never sent; numbers and counts stay
    consistent, so only the coverage shows it."""
    from prefill_svc.engine import PrefillEngine

    def make(original):
        def _emit_layer(self, job, table, layer, token_start, token_end):
            if layer != 0:
                return original(self, job, table, layer, token_start, token_end)
            real_emit, held = job.emit, []
            job.emit = held.append
            try:
                original(self, job, table, layer, token_start, token_end)
            finally:
                job.emit = real_emit
            for frame in held[:-1]:
                real_emit(frame)
            job.chunks_sent -= 1
        return _emit_layer
    _patch(PrefillEngine, "_emit_layer", make)


def prefill_forgets_nonce() -> None:
    """P-41 broken: chunks carry no nonce (their checksums made without one)."""
    import prefill_svc.kv_sender as sender  # the inline plane builds the chunk frames

    _patch_module(sender, "chunk_wire", lambda original: (
        lambda request_id, seq, layer, start, kv, nonce=b"": original(
            request_id, seq, layer, start, kv)))


def prefill_digest_of_other_tokens() -> None:
    """P-42 broken: the header's digest covers all but the last token."""
    import prefill_svc.servicer as servicer

    _patch_module(servicer, "prompt_digest", lambda original: (
        lambda token_ids: original(list(token_ids)[:-1])))


def prefill_accepts_short_nonce() -> None:
    """P-40 broken: a 1.1 request's nonce length is not checked."""
    import prefill_svc.validation as validation

    validation.NONCE_BYTES = 0
def prefill_accepts_missing_version() -> None:
    """G-02 broken: a request without protocol_version is served as 1.0."""
    from prefill_svc import servicer

    def make(original):
        def validate_prefill(request, limits):
            if not request.HasField("protocol_version"):
                versioned = handoff_pb2.PrefillRequest()
                versioned.CopyFrom(request)
                versioned.protocol_version.major = 1
                request = versioned
            return original(request, limits)
        return validate_prefill
    _patch(servicer, "validate_prefill", make)


def prefill_layer0_everywhere() -> None:
    """P-17 broken: every layer's chunks carry layer 0's K and V (well formed, crc right)."""
    import numpy as np

    from common.handoff.codec import chunk_payload
    from common.handoff.page_pieces import KvPieces, gather_into
    from common.handoff.scattered import ScatteredBytes
    from prefill_svc import kv_sender

    layer0: dict[tuple[str, int], object] = {}

    def copied(kv) -> KvPieces:
        """A copy of what pack returned (views of pages the next pass rewrites)."""
        k, v, num_tokens = chunk_payload(kv)
        halves = []
        for data in (k, v):
            own = np.empty(len(data), np.uint8)
            gather_into(own, data)
            halves.append(ScatteredBytes((own,), own.size))
        return KvPieces(*halves, num_tokens)

    def make(original):
        def chunk_wire(request_id, sequence_number, layer, token_start, kv, nonce=b""):
            if layer == 0:
                layer0[(request_id, token_start)] = copied(kv)
            else:
                kv = layer0.get((request_id, token_start), kv)
            return original(request_id, sequence_number, layer, token_start, kv, nonce)
        return chunk_wire
    _patch_module(kv_sender, "chunk_wire", make)


def prefill_kv_of_another_prompt() -> None:
    """P-17 broken: the KV (and first token) of another prompt of the same length: the prompt
    rotated by one token. Every layer differs from the others; only the content is wrong."""
    from prefill_svc.engine import PrefillEngine

    def make(original):
        def submit(self, job):
            job.token_ids = job.token_ids[1:] + job.token_ids[:1]
            return original(self, job)
        return submit
    _patch(PrefillEngine, "submit", make)


VARIANTS: dict[str, tuple[str, Callable[[], None]]] = {
    "decode_accepts_aborted": ("decode", decode_accepts_aborted),
    "decode_trusts_token_count": ("decode", decode_trusts_token_count),
    "decode_skips_checksum": ("decode", decode_skips_checksum),
    "decode_ignores_request_id": ("decode", decode_ignores_request_id),
    "decode_truncates_long_prompt": ("decode", decode_truncates_long_prompt),
    "decode_forwards_prompt_head": ("decode", decode_forwards_prompt_head),
    "decode_passes_salt_as_scope": ("decode", decode_passes_salt_as_scope),
    "decode_accepts_empty_fingerprint": ("decode", decode_accepts_empty_fingerprint),
    "decode_cancels_late": ("decode", decode_cancels_late),
    "decode_range_end_off_by_one": ("decode", decode_range_end_off_by_one),
    "decode_refuses_one_token_chunks": ("decode", decode_refuses_one_token_chunks),
    "prefill_chunks_after_rejected": ("prefill", prefill_chunks_after_rejected),
    "prefill_placeholder_over_length": ("prefill", prefill_placeholder_over_length),
    "prefill_drops_a_chunk": ("prefill", prefill_drops_a_chunk),
    "prefill_cache_keyed_by_position": ("prefill", prefill_cache_keyed_by_position),
    "decode_ignores_nonce": ("decode", decode_ignores_nonce),
    "decode_ignores_digest": ("decode", decode_ignores_digest),
    "decode_skips_frame_checksums": ("decode", decode_skips_frame_checksums),
    "decode_accepts_protocol_1_0": ("decode", decode_accepts_protocol_1_0),
    "decode_ignores_reference_on_inline": ("decode", decode_ignores_reference_on_inline),
    "decode_trusts_region_files": ("decode", decode_trusts_region_files),
    "decode_skips_finite_check": ("decode", decode_skips_finite_check),
    "decode_skips_layer0_check": ("decode", decode_skips_layer0_check),
    "decode_skips_depth_check": ("decode", decode_skips_depth_check),
    "decode_streams_prefill_first_token": ("decode", decode_streams_prefill_first_token),
    "decode_trusts_cached_tokens": ("decode", decode_trusts_cached_tokens),
    "prefill_forgets_nonce": ("prefill", prefill_forgets_nonce),
    "prefill_digest_of_other_tokens": ("prefill", prefill_digest_of_other_tokens),
    "prefill_accepts_short_nonce": ("prefill", prefill_accepts_short_nonce),
    "prefill_accepts_missing_version": ("prefill", prefill_accepts_missing_version),
    "prefill_layer0_everywhere": ("prefill", prefill_layer0_everywhere),
    "prefill_kv_of_another_prompt": ("prefill", prefill_kv_of_another_prompt),
    **BLIND_SPOT_VARIANTS,
}


def apply(name: str, role: str) -> None:
    variant_role, patch = VARIANTS[name]
    if variant_role != role:
        raise ValueError(f"variant {name} breaks {variant_role}, not {role}")
    patch()
