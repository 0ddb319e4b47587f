"""A bound on KV bytes that prefill has computed but gRPC has not yet sent.

The engine frees pool pages right after the forward pass, so without this bound a slow reader
would let serialized chunks pile up in host memory without limit. The engine thread calls
`acquire` before it hands a chunk to a job's stream and waits while the service is over its
budget; the servicer calls `release` once gRPC took the frame, and `close` when the stream
ends, which returns whatever the job still held (frames never sent).

Invariants: `pending` equals the sum of the open jobs' `held`; a closed job acquires nothing;
`acquire` never waits on a cancelled or closed job, and always admits a chunk when nothing is
pending, so one chunk larger than the budget still makes progress.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass
class JobBytes:
    held: int = 0
    closed: bool = False


class SendBudget:
    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.pending = 0
        self.waiting = 0  # acquire calls inside their wait for room right now
        self._cond = threading.Condition()

    def acquire(self, job: JobBytes, nbytes: int, cancelled: threading.Event) -> bool:
        """Blocks (engine thread) until nbytes fit; False when the job was cancelled or closed."""
        with self._cond:
            while self.pending > 0 and self.pending + nbytes > self.limit_bytes:
                if job.closed or cancelled.is_set():
                    return False
                self.waiting += 1
                try:
                    self._cond.wait(0.05)
                finally:
                    self.waiting -= 1
            if job.closed or cancelled.is_set():
                return False
            job.held += nbytes
            self.pending += nbytes
            return True

    def release(self, job: JobBytes, nbytes: int) -> None:
        with self._cond:
            taken = min(nbytes, job.held)
            job.held -= taken
            self.pending -= taken
            self._cond.notify_all()

    def close(self, job: JobBytes) -> None:
        with self._cond:
            job.closed = True
            self.pending -= job.held
            job.held = 0
            self._cond.notify_all()
