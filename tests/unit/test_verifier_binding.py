"""Protocol 1.1 in decode's verifier, from frames built in memory: the nonce, the prompt digest,
the chunk and commit checksums, and 1.0 peers only when the operator allowed them (SPEC.md
D-41..D-44). Each refusal names its reason; the accepted handoff is the control."""

from __future__ import annotations

import pytest

from common.handoff.reasons import HandoffRefused
from common.handoff.verifier import HandoffState
from common.pb.kvhandoff.v1 import handoff_pb2
from tests.helpers.frames import TWO_LAYERS, chunk, commit, full_handoff, header, verifier_for

H = TWO_LAYERS
OTHER_NONCE = bytes(range(100, 116))


def _play(frames, **kwargs):
    verifier = verifier_for(H, **kwargs)
    for frame in frames:
        verifier.on_frame(frame)
    return verifier, verifier.finish()


def _refusal(frames, **kwargs) -> str:
    with pytest.raises(HandoffRefused) as refused:
        _play(frames, **kwargs)
    return refused.value.reason


def _changed(frame: handoff_pb2.PrefillResponse, **fields) -> handoff_pb2.PrefillResponse:
    out = handoff_pb2.PrefillResponse()
    out.CopyFrom(frame)
    inner = getattr(out, out.WhichOneof("frame"))
    for name, value in fields.items():
        setattr(inner, name, value)
    return out


def test_a_bound_handoff_is_accepted():
    verifier, first = _play(full_handoff(H, first_token_id=4))
    assert (first, verifier.bound, verifier.state) == (4, True, HandoffState.COMMITTED)


@pytest.mark.parametrize("nonce", [b"", OTHER_NONCE, bytes(range(16))[:-1]])
def test_a_header_with_another_nonce_is_refused(nonce):
    frames = full_handoff(H)
    assert _refusal([header(H, nonce=nonce), *frames[1:]]) == "NONCE_MISMATCH"


def test_a_chunk_with_another_nonce_is_refused_even_with_its_checksum_right():
    frames = full_handoff(H)
    frames[2] = chunk(H, 1, 1, 0, H.token_count, nonce=OTHER_NONCE)
    assert _refusal(frames) == "NONCE_MISMATCH"


def test_a_commit_with_another_nonce_is_refused():
    frames = full_handoff(H)
    frames[-1] = commit(H, 2, nonce=OTHER_NONCE)
    assert _refusal(frames) == "NONCE_MISMATCH"


@pytest.mark.parametrize("digest_of", [(3, 1, 4, 2), (3, 1, 4), (0, 0, 0, 0)])
def test_a_digest_of_other_tokens_is_refused(digest_of):
    frames = full_handoff(H)
    assert _refusal([header(H, digest_of=digest_of), *frames[1:]]) == "PROMPT_DIGEST_MISMATCH"


@pytest.mark.parametrize("field", ["layer", "token_start", "sequence_number"])
def test_a_relabelled_chunk_fails_its_checksum(field):
    """Metadata changed in transit, payload crc still right: only the 1.1 checksum sees it."""
    frames = full_handoff(H)
    a, b = frames[1].chunk, frames[2].chunk
    if field == "layer":  # two equal-size chunks trade layers: coverage stays exact
        frames[1], frames[2] = _changed(frames[1], layer=b.layer), _changed(frames[2],
                                                                          layer=a.layer)
    elif field == "token_start":
        halves = [chunk(H, 1, 1, 0, 2), chunk(H, 2, 1, 2, 4)]
        frames = [frames[0], frames[1], _changed(halves[0], token_start=2, token_end=4),
                  _changed(halves[1], token_start=0, token_end=2), commit(H, 3)]
    else:
        frames[1], frames[2] = _changed(frames[2], sequence_number=0), _changed(
            frames[1], sequence_number=1)
    assert _refusal(frames) == "FRAME_CHECKSUM_MISMATCH"


@pytest.mark.parametrize("field, value", [("first_token_id", 5), ("status", 3),
                                          ("commit_crc32c", 12345)])
def test_a_commit_changed_after_sealing_fails_its_checksum(field, value):
    frames = full_handoff(H, first_token_id=4)
    frames[-1] = _changed(frames[-1], **{field: value})
    assert _refusal(frames) == "FRAME_CHECKSUM_MISMATCH"


def test_a_1_0_handoff_is_refused_unless_allowed():
    unbound = [_changed(f, nonce=b"") for f in full_handoff(H, first_token_id=2)]
    unbound[0] = header(H, nonce=b"", digest_of=(), minor=0)
    for frame in unbound[1:]:
        inner = getattr(frame, frame.WhichOneof("frame"))
        if frame.HasField("chunk"):
            inner.chunk_crc32c = 0
        else:
            inner.commit_crc32c = 0
    assert _refusal(unbound) == "VERSION_UNSUPPORTED"
    verifier, first = _play(unbound, allow_protocol_1_0=True)
    assert (first, verifier.bound) == (2, False)


def test_a_1_1_header_is_held_to_1_1_even_when_1_0_is_allowed():
    frames = full_handoff(H)
    frames[1] = _changed(frames[1], chunk_crc32c=1)
    assert _refusal(frames, allow_protocol_1_0=True) == "FRAME_CHECKSUM_MISMATCH"
