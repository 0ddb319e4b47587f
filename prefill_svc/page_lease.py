"""The bound on NIXL handoffs served straight from prefill's KV pages (SPEC P-68): each one keeps
its pages out of the pool (not free, not reusable, cached ones not evictable) until decode's
ReleaseHandoff or the grace period, so their number and their pages are capped; a handoff past
the cap takes the packed-buffer path instead (P-66).

Counters (the process's `Counters`): `nixl_page_leases` (handoffs served from the pages:
counted by the sender once its registration stands, so a handoff that took room here and then
fell back to the packed buffer, or ended before its first chunk, is not one),
`nixl_page_lease_fallbacks` (past the cap: packed), `nixl_lease_pages_held` and
`nixl_lease_pages_returned` (pages that passed to a hold owner when the engine was done with
their job, and that went back to the pool: held now is their difference; counters only grow, as
Prometheus counters must), `nixl_page_leases_expired` (returned by the grace period or
shutdown, not by decode).

Invariants: `take` and `give_back` pair up (each handoff that took gives back exactly once);
`pages` and `handoffs` never exceed the config's caps. Any thread (one lock).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from common.counters import Counters

DEFAULT_MAX_HANDOFFS = 64


@dataclass(frozen=True)
class PageLeaseConfig:
    """enabled: serve NIXL handoffs of a CPU pool from its pages (else always packed);
    max_pages: the most pool pages such handoffs may hold at once, 0 for half the pool;
    max_handoffs: the most such handoffs at once."""

    enabled: bool = True
    max_pages: int = 0
    max_handoffs: int = DEFAULT_MAX_HANDOFFS


class LeaseBudget:
    def __init__(self, config: PageLeaseConfig, pool_pages: int, counters: Counters) -> None:
        self.config = config
        self.max_pages = config.max_pages or max(1, pool_pages // 2)
        self.counters = counters
        self.pages = 0
        self.handoffs = 0
        self._lock = threading.Lock()

    def take(self, pages: int) -> bool:
        """Room for one more handoff of `pages` pages? True: counted (give_back later)."""
        with self._lock:
            fits = (self.config.enabled and self.handoffs < self.config.max_handoffs
                    and self.pages + pages <= self.max_pages)
            if fits:
                self.pages += pages
                self.handoffs += 1
        if not fits:
            self.counters.add("nixl_page_lease_fallbacks")
        return fits

    def give_back(self, pages: int) -> None:
        with self._lock:
            self.pages -= pages
            self.handoffs -= 1

    def why_not(self, pages: int) -> str:
        """For the log line of a fallback: the numbers and the cap that refused."""
        return (f"{pages} pages would pass the NIXL page lease cap ({self.pages} of "
                f"{self.max_pages} pages, {self.handoffs} of {self.config.max_handoffs} "
                "handoffs held)")
