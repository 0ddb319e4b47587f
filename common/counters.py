"""Event counters that engine threads and servicers bump and any thread reads: a service's
StatsService counters and refusals, which its /metrics endpoint exports as well.

Invariants: every `add` is counted exactly once, whichever threads call it; `snapshot` is a
copy taken under the same lock, so a reader (the StatsService, a Prometheus scrape on the HTTP
thread) never loses a counter nor sees one half-written. A plain dict does neither: two threads
doing `d[k] = d.get(k, 0) + 1` lose increments, and copying it while another thread adds a key
raises RuntimeError.
"""

from __future__ import annotations

import threading


class Counters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, int] = {}

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._values[name] = self._values.get(name, 0) + amount

    def get(self, name: str) -> int:
        with self._lock:
            return self._values.get(name, 0)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)
