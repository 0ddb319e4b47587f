"""What the fake prefill can do on one Prefill call (a script of steps), what a decode case
expects to happen, and helpers that build the usual scripts from a reference handoff."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import grpc

from common.pb.kvhandoff.v1 import handoff_pb2
from conformance.handoff_edit import Frame, Handoff
from conformance.regions import FakeRegions
from conformance.spec import (DEFAULT_MAX_CHUNK_BYTES, PLANE_REFUSAL_STATUS, REFUSAL_STATUS,
                              rejected_status)

DEFAULT_PROMPT_TOKENS = 24
INLINE = handoff_pb2.DATA_PLANE_INLINE
SHARED_MEMORY = handoff_pb2.DATA_PLANE_SHARED_MEMORY
# The planes on which the fake can play a case built inline: on SHARED_MEMORY it moves the
# bytes into a region (conformance.regions).
PLAYABLE_PLANES = (INLINE, SHARED_MEMORY)


@dataclass(frozen=True)
class Sleep:
    seconds: float


@dataclass(frozen=True)
class Abort:
    """End the call with a gRPC error, with an ErrorInfo when reason is set."""

    code: grpc.StatusCode
    reason: str | None
    message: str


Step = Frame | bytes | Sleep | Abort  # bytes: sent as they are (a frame that may not parse)


@dataclass(frozen=True)
class ScriptInput:
    """What the fake knows when decode calls it: decode's request and the reference's answer."""

    request: handoff_pb2.PrefillRequest
    ref: Handoff
    vocab_size: int
    decoy: Handoff | None = None  # the KV of another prompt of the same length, when asked for
    regions: FakeRegions | None = None  # on a SHARED_MEMORY handoff: where the fake may write

    @property
    def max_chunk_bytes(self) -> int:
        return self.request.max_chunk_bytes or DEFAULT_MAX_CHUNK_BYTES

    def chunks(self, pieces: int = 3) -> list[Frame]:
        """The reference KV re-cut into about `pieces` chunks per layer, layer-major."""
        per = self.ref.tokens_per_chunk(self.max_chunk_bytes, pieces)
        return self.ref.chunks(self.ref.ranges(per))

    def good(self, chunks: list[Frame] | None = None) -> list[Step]:
        """A well-formed handoff carrying `chunks` (default: `self.chunks()`)."""
        chunks = self.chunks() if chunks is None else chunks
        return [self.ref.header_with(), *chunks, self.ref.commit_with(chunk_count=len(chunks))]


Script = Callable[[ScriptInput], list[Step]]


@dataclass(frozen=True)
class Expect:
    """code None: tokens must come out. Otherwise the call must fail with code and reason
    (reason may be missing only when reason_optional, e.g. the client's own deadline)."""

    code: grpc.StatusCode | None
    reason: str | None = None
    reason_optional: bool = False

    def describe(self) -> str:
        if self.code is None:
            return "tokens; the first is the honest prefill's first token"
        reason = f"{self.reason}{' or none' if self.reason_optional else ''}"
        return f"{self.code.name} {reason}, no token"


def tokens() -> Expect:
    return Expect(None)


def refused(reason: str) -> Expect:
    return Expect(REFUSAL_STATUS.get(reason) or PLANE_REFUSAL_STATUS[reason], reason)


def peer_rejected(reason_code: str) -> Expect:
    return Expect(rejected_status(reason_code), "PEER_REJECTED")


@dataclass(frozen=True)
class DecodeCase:
    case_id: str
    rule: str
    level: str
    summary: str
    script: Script
    expect: Expect
    prompt_tokens: Callable[[object], int] | int = DEFAULT_PROMPT_TOKENS
    deadline: float | None = None  # the client's deadline for Generate; None: the suite's
    decoy: Callable[[list[int], int], list[int]] | None = None  # (prompt, vocab) -> other prompt
    planes: tuple[int, ...] = PLAYABLE_PLANES  # the planes of decode's requests it applies to

    @property
    def expectation(self) -> str:
        return f"{self.summary} -> {self.expect.describe()}"


def middle(frames: list[Frame]) -> int:
    """Index (in frames) of a chunk that is neither the first nor the last chunk."""
    chunk_at = [i for i, f in enumerate(frames) if isinstance(f, Frame) and f.HasField("chunk")]
    return chunk_at[len(chunk_at) // 2]
