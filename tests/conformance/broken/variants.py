"""Each variant monkeypatches one rule out of our prefill or decode. `apply(name)` must run
before the service starts (it patches classes, so instances made later are affected)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import google_crc32c

from common.handoff.codec import chunk_frame
from common.handoff.verifier import ABORTED, HandoffVerifier
from common.pb.kvhandoff.v1 import handoff_pb2


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
            crc = google_crc32c.extend(google_crc32c.value(bytes(chunk.k)), bytes(chunk.v))
            return original(self, _CrcOverride(chunk, crc))
        return _on_chunk
    _patch(HandoffVerifier, "_on_chunk", make)


def decode_ignores_request_id() -> None:
    """D-05 broken: frames naming another request are accepted."""
    _patch(HandoffVerifier, "_check_request_id", lambda original: (
        lambda self, frame_name, request_id: None))


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


def prefill_drops_a_chunk() -> None:
    """P-05 broken: the last chunk of layer 0 is never sent; numbers and counts stay
    consistent, so only the coverage shows it."""
    from prefill_svc.engine import PrefillEngine

    def make(original):
        def _emit_layer(self, job, table, layer):
            if layer != 0:
                return original(self, job, table, layer)
            real_emit, held = job.emit, []
            job.emit = held.append
            try:
                original(self, job, table, layer)
            finally:
                job.emit = real_emit
            for frame in held[:-1]:
                real_emit(frame)
            job.chunks_sent -= 1
        return _emit_layer
    _patch(PrefillEngine, "_emit_layer", make)


VARIANTS: dict[str, tuple[str, Callable[[], None]]] = {
    "decode_accepts_aborted": ("decode", decode_accepts_aborted),
    "decode_trusts_token_count": ("decode", decode_trusts_token_count),
    "decode_skips_checksum": ("decode", decode_skips_checksum),
    "decode_ignores_request_id": ("decode", decode_ignores_request_id),
    "prefill_chunks_after_rejected": ("prefill", prefill_chunks_after_rejected),
    "prefill_placeholder_over_length": ("prefill", prefill_placeholder_over_length),
    "prefill_drops_a_chunk": ("prefill", prefill_drops_a_chunk),
}


def apply(name: str, role: str) -> None:
    variant_role, patch = VARIANTS[name]
    if variant_role != role:
        raise ValueError(f"variant {name} breaks {variant_role}, not {role}")
    patch()
