"""Edges of decode's verifier and handoff budget that the process-level tests reach only
indirectly: max_chunk_bytes 0, the size limit, the deadline margin."""

from __future__ import annotations

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


def test_a_chunk_over_the_limit_is_refused_before_its_bytes_are_read():
    verifier = _verifier(63)
    verifier.on_frame(_header())
    with pytest.raises(HandoffRefused) as refused:
        verifier.on_frame(_chunk())
    assert refused.value.reason == "FRAME_TOO_LARGE"


@pytest.mark.parametrize(("budget", "expected"), [(60.0, 59.0), (3.0, 2.7), (0.5, 0.45)])
def test_the_prefill_call_ends_before_the_client_deadline(budget, expected):
    assert handoff_budget(budget) == pytest.approx(expected)
