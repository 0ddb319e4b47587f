"""The first check of an out-of-band chunk frame, shared by every plane whose frames carry
references (shared memory, NIXL): which chunk's bytes decode should fetch, before it reads any.

Invariant: a reference is fetched only when its size is exactly the layout's size of its token
range and K plus V fit max_chunk_bytes; any other frame goes to the verifier unchanged (which
names the rule it breaks), so nothing is read for it.
"""

from __future__ import annotations

from common.handoff.codec import WireChunkFrame
from common.handoff.layout import DEFAULT_MAX_CHUNK_BYTES
from common.handoff.reasons import refuse
from common.handoff.verifier import Expectation
from common.pb.kvhandoff.v1 import handoff_pb2


def chunk_limit(expect: Expectation) -> int:
    """The most bytes of K plus V one chunk of this handoff may carry."""
    return expect.max_chunk_bytes or DEFAULT_MAX_CHUNK_BYTES


def reference_to_fetch(frame, expect: Expectation, plane: str) -> handoff_pb2.KvChunk | None:
    """The chunk whose referenced bytes decode should fetch, or None when the frame goes to the
    verifier as it is. Raises REFERENCE_UNEXPECTED for a chunk with both bytes and a reference
    (plane names the reference in the message)."""
    if frame is None or isinstance(frame, WireChunkFrame) or frame.WhichOneof("frame") != "chunk":
        return None  # a WireChunkFrame is an inline chunk (the fast parser reads no reference)
    chunk = frame.chunk
    if not chunk.HasField("ref"):
        return None  # inline bytes: checked as on INLINE (empty ones: CHUNK_SIZE_MISMATCH)
    if len(chunk.k) or len(chunk.v):
        raise refuse("REFERENCE_UNEXPECTED", f"chunk {chunk.sequence_number} carries both "
                     f"inline bytes and a {plane} reference")
    tokens = chunk.token_end - chunk.token_start
    if tokens <= 0 or tokens > expect.token_count or 2 * chunk.ref.length > chunk_limit(expect):
        return None  # out of range or too large: the verifier names the rule (the reference's
        # size counts as the chunk's, common.handoff.verifier.carried_sizes), nothing read
    if chunk.ref.length != tokens * expect.layout.k_bytes_per_token_per_layer:
        return None  # the verifier refuses the size (CHUNK_SIZE_MISMATCH)
    return chunk
