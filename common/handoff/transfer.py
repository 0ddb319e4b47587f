"""The state of one KV transfer, as either side of any data plane sees it.

Like SGLang's KVPoll: a transfer is WAITING (asked for, no byte landed yet), TRANSFERRING (some
chunks landed or left), then exactly one of SUCCESS or FAILED, both terminal. Every sender and
receiver (inline gRPC bytes, shared memory, local prefill, the test fake) reports through a
`TransferRecord`, so the servicers and the tests read one state machine whatever the plane.

Invariants: states only move forward (WAITING -> TRANSFERRING -> SUCCESS | FAILED; WAITING ->
FAILED); SUCCESS is reached only after the bytes a receiver landed were verified (checksums over
its own copy, then the content checks); a FAILED transfer's bytes are never used.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field


class TransferState(enum.Enum):
    WAITING = "waiting"
    TRANSFERRING = "transferring"
    SUCCESS = "success"
    FAILED = "failed"


_NEXT: dict[TransferState, frozenset[TransferState]] = {
    TransferState.WAITING: frozenset({TransferState.TRANSFERRING, TransferState.FAILED,
                                      TransferState.SUCCESS}),
    TransferState.TRANSFERRING: frozenset({TransferState.SUCCESS, TransferState.FAILED}),
    TransferState.SUCCESS: frozenset(),
    TransferState.FAILED: frozenset(),
}


class TransferStateError(RuntimeError):
    """A transport tried to move a transfer backwards or out of a terminal state."""


@dataclass
class TransferRecord:
    """One handoff's transfer on one plane; `bytes_landed` counts verified payload bytes."""

    request_id: str
    plane: str
    state: TransferState = TransferState.WAITING
    bytes_landed: int = 0
    failure: str = ""  # the refusal reason once FAILED
    # time.monotonic() of the receiver's milestones (call opened, header, first and last
    # chunk, commit), first time each is reached: for the handoff's timeline in decode's log
    marks: dict[str, float] = field(default_factory=dict)
    # decode: called with each verified chunk once its bytes are landed or queued for the
    # pages (the content checks run layer by layer as the KV lands); None: nobody listens
    on_chunk: Callable[[object], None] | None = field(default=None, repr=False, compare=False)

    def mark(self, name: str) -> None:
        self.marks.setdefault(name, time.monotonic())

    def move(self, state: TransferState, failure: str = "") -> None:
        if state == self.state and state == TransferState.TRANSFERRING:
            return
        if state not in _NEXT[self.state]:
            raise TransferStateError(f"transfer {self.request_id} on {self.plane}: "
                                     f"{self.state.value} -> {state.value} is not allowed")
        self.state = state
        if state == TransferState.FAILED:
            self.failure = failure

    @property
    def done(self) -> bool:
        return self.state in (TransferState.SUCCESS, TransferState.FAILED)
