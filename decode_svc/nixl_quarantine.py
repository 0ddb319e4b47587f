"""Pages a NIXL READ may still land in (SPEC D-67a): when a READ straight into a reservation's
pages did not end DONE (it timed out, failed, or the client left while it was in flight),
those pages leave the request under a quarantine owner (`PageAllocator.rename`: nothing goes
to the free list), the request gets fresh pages when the pool has them (so a retry never lands
in pages a late READ can overwrite), and a watcher thread polls the transfer until NIXL says it
is over (DONE or ERR) and its handle is released; only then are the pages released, through
the engine (which poisons or scrubs them as for any release).

Invariants: a quarantined page is owned by its quarantine owner until the transfer is known
over, so the pool never hands it to another request before that; a handle NIXL cannot release
keeps its pages for good (counted); `held_pages` counts what is quarantined now. Any thread
(one lock); the watcher needs no event loop, so pages come back whichever loop posted the READ.
"""

from __future__ import annotations

import itertools
import threading
import time

from common.counters import Counters
from common.handoff.nixl_agent import IN_FLIGHT, NixlAgent
from common.kvpool.allocator import PoolExhausted

POLL_S = 2e-3


class ReadQuarantine:
    def __init__(self, agent: NixlAgent, counters: Counters) -> None:
        self.agent = agent
        self.counters = counters
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._held: dict[str, tuple[object, object, int]] = {}  # owner -> (handle, engine, pages)
        self._watcher: threading.Thread | None = None
        self._stopped = False

    @property
    def held_pages(self) -> int:
        with self._lock:
            return sum(pages for _, _, pages in self._held.values())

    def owners(self) -> list[str]:
        with self._lock:
            return list(self._held)

    def hold(self, engine, request_id: str, handle) -> str:
        """request_id's pages (a READ posted with handle may still land in them) -> the
        quarantine owner now holding them; request_id gets as many fresh pages if free."""
        allocator = engine.pool.allocator
        owner = f"nixl-quarantine-{next(self._ids)}:{request_id}"
        try:
            pages = len(allocator.page_table(request_id))
            allocator.rename(request_id, owner)
        except KeyError:  # released already (never while its handoff runs): watch the READ
            pages = 0
        else:
            try:
                allocator.allocate(request_id, pages * allocator.page_size)
            except PoolExhausted:  # the request goes on without pages: its Verify refuses it
                self.counters.add("nixl_quarantine_left_request_without_pages")
        self.counters.add("nixl_reads_quarantined")
        self.counters.add("nixl_pages_quarantined", pages)
        with self._lock:
            self._held[owner] = (handle, engine, pages)
            if self._watcher is None:
                self._watcher = threading.Thread(target=self._watch, name="nixl-quarantine",
                                                 daemon=True)
                self._watcher.start()
        return owner

    def _watch(self) -> None:
        while True:
            with self._lock:
                if not self._held or self._stopped:
                    self._watcher = None
                    return
                held = list(self._held.items())
            for owner, (handle, engine, _) in held:
                try:
                    over = self.agent.state(handle) != IN_FLIGHT
                except Exception:  # NIXL no longer knows the handle: it is over
                    over = True
                if over:
                    self._end(owner, handle, engine)
            time.sleep(POLL_S)

    def _end(self, owner: str, handle, engine) -> None:
        with self._lock:
            self._held.pop(owner, None)
        if not self.agent.release(handle):  # NIXL could not free it: keep the pages for good
            self.counters.add("nixl_pages_withdrawn")
            return
        engine.release(owner)  # the engine thread frees (and poisons) them
        self.counters.add("nixl_quarantines_ended")

    def close(self) -> None:
        """Stops the watcher (shutdown): what is still held stays held."""
        with self._lock:
            self._stopped = True
