"""Protocol 1.2 on prefill: the commit reports how many prompt tokens the prefix cache served
(HandoffCommit.cached_tokens, SPEC.md P-90, D-90).

The engine thread builds the commit without it; the servicer, which knows the request's minor
version, stamps it on the way out. Invariants: only an OK commit changes, only when the count is
not 0, and the stamped commit's checksum covers the count (section 3.1), so a commit without it
keeps its 1.1 bytes and checksum; a 1.0 or 1.1 request never gets the field.
"""

from __future__ import annotations

from common.handoff.codec import commit_frame, frame_wire
from common.pb.kvhandoff.v1 import handoff_pb2

_COMMIT_TAG = 0x1A  # PrefillResponse.commit: field 3, length-delimited


def with_cached_tokens(frame: bytes, cached_tokens: int) -> bytes:
    """A serialized PrefillResponse -> the same with cached_tokens set on an OK commit (its
    checksum recomputed); any other frame, or a count of 0, unchanged. Commits are small: the
    parse and re-serialization cost nothing next to a chunk."""
    if not cached_tokens or not frame or frame[0] != _COMMIT_TAG:
        return frame
    commit = handoff_pb2.PrefillResponse.FromString(frame).commit
    if commit.status != handoff_pb2.HANDOFF_STATUS_OK:
        return frame
    return frame_wire(commit_frame(commit.request_id, commit.token_count, commit.chunk_count,
                                   commit.first_token_id, commit.status, commit.reason,
                                   commit.nonce, cached_tokens))
