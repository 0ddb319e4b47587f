"""What prefill keeps pinned for decode after a handoff's stream: out-of-band senders
(`pins_bytes`: a region, a registered buffer, or the KV pages themselves) whose bytes decode may
still be reading, until decode releases them or a grace period passes.

Keys are (request id, nonce): only the decode that asked (it alone knows the nonce) releases a
handoff. Invariants: every sender added is released exactly once, by `release` (decode's
ReleaseHandoff), by the grace timer `stream_ended` starts, or by `close` (shutdown); a release
for an unknown or already released handoff answers False and changes nothing. Event loop only.
`regions`: the shared-memory region files kept for reuse (common.handoff.region_pool); only a
handoff decode released gives its file back to it, and `close` empties it.
"""

from __future__ import annotations

import asyncio

from common.counters import Counters
from common.handoff.region_pool import RegionPool
from prefill_svc.kv_sender import KvSender

DEFAULT_GRACE_S = 5.0


class HandoffLeases:
    def __init__(self, grace_s: float, counters: Counters,
                 regions: RegionPool | None = None) -> None:
        self.grace_s = grace_s
        self.counters = counters
        self.regions = regions if regions is not None else RegionPool()
        self._prune_timer: asyncio.TimerHandle | None = None
        self._held: dict[tuple[str, bytes], tuple[KvSender, bool]] = {}
        self._timers: dict[tuple[str, bytes], asyncio.TimerHandle] = {}

    def held(self) -> int:
        return len(self._held)

    def add(self, request_id: str, nonce: bytes, sender: KvSender) -> None:
        self._held[(request_id, bytes(nonce))] = (sender, False)

    def stream_ended(self, request_id: str, nonce: bytes, completed: bool) -> None:
        """The Prefill stream is over; decode has grace_s to release before prefill does."""
        key = (request_id, bytes(nonce))
        if key not in self._held:
            return
        self._held[key] = (self._held[key][0], completed)
        loop = asyncio.get_running_loop()
        self._timers[key] = loop.call_later(self.grace_s, self._expire, key)

    def _expire(self, key: tuple[str, bytes]) -> None:
        if self._drop(key):
            self._count("handoff_releases_expired")

    def release(self, request_id: str, nonce: bytes) -> bool:
        released = self._drop((request_id, bytes(nonce)), peer_done=True)
        if released:
            self._count("handoff_releases")
        return released

    def close(self) -> None:
        for key in list(self._held):
            self._drop(key)
        if self._prune_timer is not None:
            self._prune_timer.cancel()
            self._prune_timer = None
        self.regions.close()

    def _drop(self, key: tuple[str, bytes], peer_done: bool = False) -> bool:
        entry = self._held.pop(key, None)
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        if entry is None:
            return False
        sender, completed = entry
        sender.release(completed, peer_done)
        self._schedule_prune()
        return True

    def _schedule_prune(self) -> None:
        """One timer at a time: prunes the region pool every max_idle_s while it holds
        anything, so idle files do not outlive the traffic by much more than that."""
        if self._prune_timer is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (shutdown after it stopped): close() empties the pool
            return
        self._prune_timer = loop.call_later(self.regions.config.max_idle_s + 0.1, self._prune)

    def _prune(self) -> None:
        self._prune_timer = None
        if self.regions.prune():
            self._schedule_prune()

    def _count(self, name: str) -> None:
        self.counters.add(name)
