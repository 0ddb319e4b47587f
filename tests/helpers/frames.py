"""Handoff frames built in memory for in-process verifier tests: a correct 1.1 handoff of a
small prompt, and the pieces to change it one way at a time."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.handoff.binding import prompt_digest
from common.handoff.codec import chunk_frame, commit_frame, header_frame
from common.handoff.layout import KvLayout
from common.handoff.verifier import Expectation, HandoffVerifier
from common.pb.kvhandoff.v1 import handoff_pb2

OK = handoff_pb2.HANDOFF_STATUS_OK


@dataclass(frozen=True)
class Handoff:
    """What decode asked for; frames built from it are correct unless a test changes them."""

    request_id: str
    token_ids: tuple[int, ...]
    layout: KvLayout
    fingerprint: str = "fp"
    nonce: bytes = bytes(range(16))
    vocab_size: int = 10

    @property
    def token_count(self) -> int:
        return len(self.token_ids)


TINY = Handoff("r1", (1, 2), KvLayout(num_layers=1, num_kv_heads=1, head_dim=4,
                                       dtype=torch.float32))
TWO_LAYERS = Handoff("r2", (3, 1, 4, 1), KvLayout(num_layers=2, num_kv_heads=1, head_dim=2,
                                                   dtype=torch.float32))


def expectation(h: Handoff, max_chunk_bytes: int = 1 << 20,
                allow_protocol_1_0: bool = False) -> Expectation:
    return Expectation(h.request_id, h.token_count, h.layout, h.fingerprint, max_chunk_bytes,
                       h.vocab_size, h.nonce, prompt_digest(h.token_ids), allow_protocol_1_0)


def verifier_for(h: Handoff, **kwargs) -> HandoffVerifier:
    return HandoffVerifier(expectation(h, **kwargs))


def header(h: Handoff, status: int = OK, digest_of: tuple[int, ...] | None = None,
           nonce: bytes | None = None, minor: int | None = None) -> handoff_pb2.PrefillResponse:
    frame = header_frame(h.request_id, h.token_count, status, h.layout, h.fingerprint,
                         nonce=h.nonce if nonce is None else nonce,
                         digest=prompt_digest(h.token_ids if digest_of is None else digest_of))
    if minor is not None:
        frame.header.protocol_version.minor = minor
    return frame


def kv_values(h: Handoff, layer: int, start: int, end: int) -> torch.Tensor:
    """Deterministic, distinct KV of layer for tokens [start, end): [2, n, Hkv, D]."""
    lay = h.layout
    n = (end - start) * lay.num_kv_heads * lay.head_dim
    base = 1000 * layer + start * lay.num_kv_heads * lay.head_dim
    values = torch.arange(base, base + 2 * n, dtype=torch.float32).to(lay.dtype)
    return values.view(2, end - start, lay.num_kv_heads, lay.head_dim)


def chunk(h: Handoff, seq: int, layer: int, start: int, end: int,
          nonce: bytes | None = None) -> handoff_pb2.PrefillResponse:
    return chunk_frame(h.request_id, seq, layer, start, kv_values(h, layer, start, end),
                       h.nonce if nonce is None else nonce)


def commit(h: Handoff, chunk_count: int, first_token_id: int = 0, status: int = OK,
           nonce: bytes | None = None) -> handoff_pb2.PrefillResponse:
    return commit_frame(h.request_id, h.token_count, chunk_count, first_token_id, status,
                        nonce=h.nonce if nonce is None else nonce)


def full_handoff(h: Handoff, first_token_id: int = 0) -> list[handoff_pb2.PrefillResponse]:
    """header, one chunk per layer, commit: a handoff the verifier accepts."""
    chunks = [chunk(h, layer, layer, 0, h.token_count) for layer in range(h.layout.num_layers)]
    return [header(h), *chunks, commit(h, len(chunks), first_token_id)]
