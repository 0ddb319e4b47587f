"""Whether borrowed threads still pay: decode's step times with and without them, compared now
and then.

A team of torch threads is only as fast as its slowest member: when something else runs on a
borrowed core (another tenant, a noisy neighbour, the peer's own spinning threads), a borrowed
step can take longer than one on the service's own cores. So every `probe_every` borrowed steps
the guard asks for `probe_steps` steps on the own threads alone, and if those were not slower by
`min_gain` than the borrowed steps just before them, borrowing stops for `backoff_steps` steps.

Invariants: the guard only advises (`wants_borrow`), the caller counts every step it ran
(`step_done`, with the threads it ran on), and a step on the own threads outside a probe never
counts against borrowing. Engine thread only.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class BorrowGuardConfig:
    probe_every: int = 64  # borrowed steps between probes
    probe_steps: int = 4  # own-thread steps a probe runs
    min_gain: float = 1.1  # own-thread step time over borrowed step time that keeps borrowing
    backoff_steps: int = 512  # steps on the own threads after a probe that did not pay


class BorrowGuard:
    def __init__(self, config: BorrowGuardConfig = BorrowGuardConfig(), counters=None) -> None:
        self.config = config
        self._counters = counters
        self._borrowed: deque[float] = deque(maxlen=config.probe_steps)
        self._own: list[float] = []
        self._since_probe = 0
        self._backoff = 0
        self._probing = False

    def wants_borrow(self) -> bool:
        """Whether the next step should run on the borrowed threads (when borrowing is allowed
        at all: the caller decides that)."""
        if self._backoff > 0:
            return False
        if not self._probing and self._since_probe >= self.config.probe_every:
            self._probing, self._own = True, []
        return not self._probing

    def step_done(self, seconds: float, borrowed: bool) -> None:
        """One step ran for seconds, on the borrowed threads or not."""
        if self._backoff > 0:
            self._backoff -= 1
            return
        if borrowed:
            self._borrowed.append(seconds)
            self._since_probe += 1
            return
        if not self._probing:
            return
        self._own.append(seconds)
        if len(self._own) < self.config.probe_steps:
            return
        self._probing, self._since_probe = False, 0
        if (len(self._borrowed) == self.config.probe_steps and statistics.median(self._own)
                < self.config.min_gain * statistics.median(self._borrowed)):
            self._backoff = self.config.backoff_steps
            if self._counters is not None:
                self._counters.add("core_borrow_backoffs")
        self._borrowed.clear()
