"""Edges of decode's verifier and handoff budget that the process-level tests reach only
indirectly: a frame that did not parse, max_chunk_bytes 0, the deadline margin."""

from __future__ import annotations

from types import SimpleNamespace

import google_crc32c
import pytest
import torch

from common.handoff.layout import KvLayout
from common.handoff.reasons import HandoffRefused
from common.handoff.verifier import Expectation, HandoffState, HandoffVerifier
from common.pb.kvhandoff.v1 import common_pb2, handoff_pb2
from decode_svc.handoff import handoff_budget

LAYOUT = KvLayout(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32)


def _verifier(max_chunk_bytes: int) -> HandoffVerifier:
    return HandoffVerifier(Expectation("r1", 2, LAYOUT, "fp", max_chunk_bytes, vocab_size=10))


def _header() -> handoff_pb2.PrefillResponse:
    return handoff_pb2.PrefillResponse(header=handoff_pb2.HandoffHeader(
        protocol_version=common_pb2.ProtocolVersion(major=1), request_id="r1", token_count=2,
        status=handoff_pb2.HANDOFF_STATUS_OK, layout=LAYOUT.to_proto(), model_fingerprint="fp"))


def _chunk() -> handoff_pb2.PrefillResponse:
    k, v = bytes(range(32)), bytes(range(32, 64))
    return handoff_pb2.PrefillResponse(chunk=handoff_pb2.KvChunk(
        request_id="r1", sequence_number=0, layer=0, token_start=0, token_end=2, k=k, v=v,
        crc32c=google_crc32c.extend(google_crc32c.value(k), v)))


def test_a_frame_that_did_not_parse_is_refused():
    verifier = _verifier(1 << 20)
    verifier.on_frame(_header())
    with pytest.raises(HandoffRefused) as refused:
        verifier.on_frame(None)
    assert refused.value.reason == "FRAME_MALFORMED"
    assert verifier.state == HandoffState.REFUSED


def test_max_chunk_bytes_zero_means_the_default():
    verifier = _verifier(0)
    verifier.on_frame(_header())
    assert verifier.on_frame(_chunk()) is not None
    verifier.on_frame(handoff_pb2.PrefillResponse(commit=handoff_pb2.HandoffCommit(
        request_id="r1", token_count=2, chunk_count=1, first_token_id=3,
        status=handoff_pb2.HANDOFF_STATUS_OK)))
    assert verifier.finish() == 3


class _Unreadable:
    """A payload whose length is known but whose bytes cannot be read: checksumming or copying
    it raises TypeError."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size


class _ChunkFrame:
    """A chunk frame as the verifier reads one (WhichOneof, .chunk), around any payload."""

    def __init__(self, **fields) -> None:
        self.chunk = SimpleNamespace(**fields)

    def WhichOneof(self, oneof: str) -> str:  # noqa: N802 (the protobuf method's name)
        return "chunk"


def test_a_chunk_over_the_limit_is_refused_before_its_bytes_are_read():
    """Refused on the lengths alone: the payload is never read, and neither its size against
    the layout (40 bytes each where 2 tokens need 32) nor its crc32c (0) is checked first."""
    verifier = _verifier(63)
    verifier.on_frame(_header())
    frame = _ChunkFrame(request_id="r1", sequence_number=0, layer=0, token_start=0, token_end=2,
                        k=_Unreadable(40), v=_Unreadable(40), crc32c=0)
    with pytest.raises(HandoffRefused) as refused:
        verifier.on_frame(frame)
    assert refused.value.reason == "FRAME_TOO_LARGE"


@pytest.mark.parametrize(("budget", "expected"), [(60.0, 59.0), (3.0, 2.7), (0.5, 0.45)])
def test_the_prefill_call_ends_before_the_client_deadline(budget, expected):
    assert handoff_budget(budget) == pytest.approx(expected)
