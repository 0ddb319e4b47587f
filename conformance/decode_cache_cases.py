"""The decode cases of protocol 1.2's cached-token count (SPEC.md D-90): a 1.2 commit whose
`cached_tokens` is out of bounds, every id, nonce, digest and checksum right (the checksum
covers the count), is refused before any token; decode never reports such a count."""

from __future__ import annotations

from common.pb.kvhandoff.v1 import common_pb2
from conformance.decode_script import DecodeCase, ScriptInput, Step, refused

MINOR_CACHED = 2  # SPEC.md section 4: 1.2 adds HandoffCommit.cached_tokens


def with_cached_tokens(i: ScriptInput, cached: int) -> list[Step]:
    """A 1.2 handoff of the reference KV whose sealed commit claims `cached` cached tokens."""
    good = i.good()
    version = common_pb2.ProtocolVersion(major=1, minor=MINOR_CACHED)
    return [i.ref.header_with(protocol_version=version), *good[1:-1],
            i.ref.commit_with(chunk_count=len(good) - 2, cached_tokens=cached)]


def cache_count_cases() -> list[DecodeCase]:
    return [
        DecodeCase("cached_tokens_whole_prompt", "D-90", "MUST", "1.2 commit says every prompt "
                   "token came from prefill's cache (the last one never can), checksum right",
                   lambda i: with_cached_tokens(i, len(i.request.token_ids)),
                   refused("CACHED_TOKENS_INVALID")),
        DecodeCase("cached_tokens_part_page", "D-90", "MUST", "1.2 commit says 1 prompt token "
                   "came from prefill's cache: not a whole page, checksum right",
                   lambda i: with_cached_tokens(i, 1), refused("CACHED_TOKENS_INVALID")),
    ]
