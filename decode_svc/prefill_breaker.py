"""A circuit breaker per prefill replica: a replica whose handoffs keep failing is ejected from
the choice for a cool-down, then given one trial handoff.

States: CLOSED (chosen as usual) -> OPEN after `failures_to_eject` consecutive failed handoffs
(a transport failure, a refusal of its form, a timeout); OPEN lasts `cool_down_s`, then the
replica is HALF_OPEN: it may be chosen for one handoff at a time; that handoff's success closes
the breaker, its failure opens it again for another cool-down. Any success resets the count.

Invariants: `allows(now)` is False exactly while OPEN, or HALF_OPEN with its trial in flight;
`ejections` counts every move to OPEN (prefill_ejected_total). The clock is passed in, so tests
drive it; event loop only.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

DEFAULT_FAILURES_TO_EJECT = 3
DEFAULT_COOL_DOWN_S = 10.0


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class BreakerConfig:
    failures_to_eject: int = DEFAULT_FAILURES_TO_EJECT
    cool_down_s: float = DEFAULT_COOL_DOWN_S


class CircuitBreaker:
    def __init__(self, config: BreakerConfig | None = None) -> None:
        config = config or BreakerConfig()
        if config.failures_to_eject < 1 or config.cool_down_s < 0:
            raise ValueError(f"a breaker needs failures_to_eject >= 1 and cool_down_s >= 0, "
                             f"got {config}")
        self.config = config
        self.state = BreakerState.CLOSED
        self.failures = 0  # consecutive
        self.ejections = 0
        self._open_until = 0.0
        self._trial_in_flight = False

    def allows(self, now: float) -> bool:
        if self.state == BreakerState.OPEN and now >= self._open_until:
            self.state = BreakerState.HALF_OPEN
            self._trial_in_flight = False
        if self.state == BreakerState.OPEN:
            return False
        return not (self.state == BreakerState.HALF_OPEN and self._trial_in_flight)

    def started(self) -> None:
        """A handoff was sent to the replica (after `allows` said yes)."""
        if self.state == BreakerState.HALF_OPEN:
            self._trial_in_flight = True

    def succeeded(self) -> None:
        self.state = BreakerState.CLOSED
        self.failures = 0
        self._trial_in_flight = False

    def failed(self, now: float) -> bool:
        """Counts a failed handoff; True when this failure ejected the replica."""
        self.failures += 1
        if self.state == BreakerState.OPEN:
            return False  # a handoff that started before the ejection ended badly
        if self.state == BreakerState.HALF_OPEN or self.failures >= self.config.failures_to_eject:
            self.state = BreakerState.OPEN
            self._open_until = now + self.config.cool_down_s
            self._trial_in_flight = False
            self.ejections += 1
            return True
        return False

    def ended_unjudged(self) -> None:
        """The handoff ended for a reason that says nothing of the replica (the client left)."""
        self._trial_in_flight = False
