"""Edges of decode's verifier and handoff budget that the process-level tests reach only
indirectly: max_chunk_bytes 0, the size limit, the deadline margin."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from common.handoff.reasons import HandoffRefused
from decode_svc.handoff import handoff_budget
from tests.helpers.frames import TINY, chunk, commit, header, verifier_for


def _verifier(max_chunk_bytes: int):
    return verifier_for(TINY, max_chunk_bytes=max_chunk_bytes)


def _header():
    return header(TINY)


def _chunk():
    return chunk(TINY, 0, 0, 0, 2)


def test_max_chunk_bytes_zero_means_the_default():
    verifier = _verifier(0)
    verifier.on_frame(_header())
    assert verifier.on_frame(_chunk()) is not None
    verifier.on_frame(commit(TINY, chunk_count=1, first_token_id=3))
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
    frame = _ChunkFrame(request_id="r1", nonce=TINY.nonce, sequence_number=0, layer=0,
                        token_start=0, token_end=2, k=_Unreadable(40), v=_Unreadable(40),
                        crc32c=0)
    with pytest.raises(HandoffRefused) as refused:
        verifier.on_frame(frame)
    assert refused.value.reason == "FRAME_TOO_LARGE"


@pytest.mark.parametrize(("budget", "expected"), [(60.0, 59.0), (3.0, 2.7), (0.5, 0.45)])
def test_the_prefill_call_ends_before_the_client_deadline(budget, expected):
    assert handoff_budget(budget) == pytest.approx(expected)
