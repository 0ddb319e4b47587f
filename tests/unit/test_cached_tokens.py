"""Protocol 1.2's cached-token count (SPEC.md P-90, D-90), in process: prefill's servicer stamps
it on an OK commit only, its checksum covering it; decode's verifier takes a bounded count from
a 1.2 commit, reads 0 from a 1.1 one whatever it holds, and refuses a count whose checksum was
not recomputed. (The refusals of out-of-bounds counts are cases of test_verifier_states.)"""

from __future__ import annotations

import dataclasses

import pytest

from common.handoff.binding import commit_checksum
from common.handoff.codec import commit_frame, frame_wire, header_frame
from common.handoff.reasons import HandoffRefused
from common.handoff.verifier import HandoffVerifier
from common.pb.kvhandoff.v1 import common_pb2, handoff_pb2
from prefill_svc.cached_commit import with_cached_tokens
from tests.unit.test_verifier_states import (EXPECT, FIRST, NONCE, RID, TOKENS, chunks, commit,
                                             header)

V1_2 = common_pb2.ProtocolVersion(major=1, minor=2)


def verified(first_frame, last_frame, page: int = 2) -> HandoffVerifier:
    verifier = HandoffVerifier(dataclasses.replace(EXPECT, cache_page_size=page))
    for frame in [first_frame, *chunks(), last_frame]:
        verifier.on_frame(frame)
    assert verifier.finish() == FIRST
    return verifier


def test_a_1_2_commit_reports_its_whole_pages_from_the_cache():
    assert verified(header(protocol_version=V1_2), commit(cached_tokens=2)).cached_tokens == 2
    assert verified(header(protocol_version=V1_2), commit()).cached_tokens == 0


def test_a_1_1_handoff_means_0_whatever_its_commit_holds():
    # minor 1 has no such field: a stray value is not read (its checksum still covers it)
    assert verified(header(), commit(cached_tokens=2)).cached_tokens == 0


def test_a_count_changed_after_sealing_fails_the_commit_checksum():
    sealed = commit().commit.commit_crc32c  # sealed over cached_tokens 0
    verifier = HandoffVerifier(dataclasses.replace(EXPECT, cache_page_size=2))
    for frame in [header(protocol_version=V1_2), *chunks()]:
        verifier.on_frame(frame)
    with pytest.raises(HandoffRefused) as refused:
        verifier.on_frame(commit(cached_tokens=2, commit_crc32c=sealed))
    assert refused.value.reason == "FRAME_CHECKSUM_MISMATCH"


def test_a_count_of_0_keeps_the_1_1_checksum():
    assert (commit_checksum(RID, NONCE, TOKENS, 4, FIRST, 1, 0)
            == commit_checksum(RID, NONCE, TOKENS, 4, FIRST, 1))
    assert (commit_checksum(RID, NONCE, TOKENS, 4, FIRST, 1, 16)
            != commit_checksum(RID, NONCE, TOKENS, 4, FIRST, 1))


def test_prefill_stamps_only_an_ok_commit_with_a_count():
    ok = frame_wire(commit_frame(RID, TOKENS, 4, FIRST, nonce=NONCE))
    stamped = handoff_pb2.PrefillResponse.FromString(with_cached_tokens(ok, 2)).commit
    assert stamped.cached_tokens == 2
    assert stamped.commit_crc32c == commit_checksum(RID, NONCE, TOKENS, 4, FIRST,
                                                    handoff_pb2.HANDOFF_STATUS_OK, 2)
    assert with_cached_tokens(ok, 0) == ok
    aborted = frame_wire(commit_frame(RID, TOKENS, 0, 0, handoff_pb2.HANDOFF_STATUS_ABORTED,
                                      "failed", NONCE))
    assert with_cached_tokens(aborted, 2) == aborted
    head = frame_wire(header_frame(RID, TOKENS, handoff_pb2.HANDOFF_STATUS_OK, None, "fp",
                                   nonce=NONCE))
    assert with_cached_tokens(head, 2) == head
