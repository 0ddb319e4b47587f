"""Two services of a pair on one host lend each other their idle cores.

`kvhandoff up` splits the host's cores between prefill and decode, so neither slows the other;
but at low load one of them idles while the other computes on half the machine (one client:
decode waits while prefill computes its prompt, then prefill waits while decode steps). Each
engine thread therefore raises its torch intra-op threads to `own + borrowed` while the other
side is known to be idle, and drops back to `own` otherwise:

- decode knows when prefill works for it: from the moment it reserves pages for a handoff until
  the KV has arrived (`awaiting`). While nothing awaits KV it borrows prefill's cores;
- prefill cannot see decode's batch, so decode holds an advisory lock (flock) on a file, the
  *busy file*, whenever it has sequences running or KV to check; prefill borrows decode's cores
  for a pass only if that lock is free when the pass starts (it takes and drops it at once:
  holding it for the pass would lock decode out of its own signal while prefill's passes run
  back to back), and goes back to its own threads after the first layer that finds it held.

Borrowed threads pay only while the borrowed cores are free: decode checks its own steps with
and without them now and then and stops borrowing for a while when they do not
(common/server/borrow_guard.py); prefill borrows only for passes of at least
`min_borrow_tokens` (on the bench checkpoint at 1 client, a 1024-token prompt's TTFT fell from
~480 to ~330 ms with a borrowed pass, while a 128-token one rose from 59 to 73 ms: a short pass
gains less than it loses to decode's content checks, which run while the KV lands). While a
pass runs on borrowed threads prefill also holds a second lock, the *lent file* (the busy file's
name + ".lent"), so that decode can see it (`peer_borrowing`) and leave its cores to that pass
(decode_svc.content_pipeline: the checks then run after the commit, on its own and borrowed
threads, instead of beside the pass).

Invariants: neither side ever waits for the lock (a side that cannot take it computes with its
own threads), so a lock held by a stalled or killed peer costs speed, never progress (flock locks
die with their holder); the thread count changes only on the engine thread, between steps or
passes; with borrowed == 0 nothing changes and no file is opened. The lock is a hint about speed,
never about correctness: the pages and the KV do not depend on it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from common.server.borrow_guard import BorrowGuard
from common.server.torch_threads import take_team


@dataclass(frozen=True)
class CoreBorrowingConfig:
    own_threads: int = 0  # torch threads on the service's own cores (0: leave torch's count)
    borrowed_threads: int = 0  # extra threads while the peer is idle (0: never borrow)
    busy_file: str = ""  # the lock file both services of the pair name
    min_borrow_tokens: int = 512  # prefill: the shortest pass that borrows
    own_cpus: tuple[int, ...] = ()  # the engine thread stays on these ((): wherever it runs)
    borrowed_cpus: tuple[int, ...] = ()  # where the borrowed threads may run

    @property
    def enabled(self) -> bool:
        return self.borrowed_threads > 0 and self.own_threads > 0


class _BusyLock:
    """A non-blocking exclusive flock on one file; held or not, never waited for."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self.held = False

    def try_take(self) -> bool:
        if not self.held:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self.held = True
            except BlockingIOError:
                return False
        return True

    def held_elsewhere(self) -> bool:
        """Whether another holder has it now: taken and given back at once when free (a lock
        this side holds stays held)."""
        if self.held:
            return False
        if not self.try_take():
            return True
        self.give_back()
        return False

    def give_back(self) -> None:
        if self.held:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            self.held = False

    def close(self) -> None:
        self.give_back()
        os.close(self._fd)


class CoreBorrowing:
    """The engine thread's torch thread count, by the rule above. A disabled one does nothing."""

    def __init__(self, config: CoreBorrowingConfig, counters=None) -> None:
        self.config = config
        self._counters = counters
        self._lock = _BusyLock(config.busy_file) if config.enabled and config.busy_file else None
        self._lent = (_BusyLock(config.busy_file + ".lent") if self._lock is not None
                      else None)  # prefill holds it while a pass borrows
        self._threads = config.own_threads
        self._guard = BorrowGuard(counters=counters)
        self._workers_started = False

    def _start_workers(self, threads: int) -> None:
        """The engine thread's first borrow: torch's worker threads start from this thread and
        take its CPU mask, so they start while it may run on own and borrowed CPUs; then the
        engine thread goes back to its own, and only the workers reach the borrowed ones."""
        self._workers_started = True
        if not self.config.own_cpus:
            return
        os.sched_setaffinity(0, (*self.config.own_cpus, *self.config.borrowed_cpus))
        torch.set_num_threads(threads)
        a = torch.ones(256, 256)
        _ = a @ a  # a parallel op: the team of `threads` exists from here on
        os.sched_setaffinity(0, self.config.own_cpus)

    def on_engine_thread(self) -> None:
        """Called once by the engine thread when it starts: it runs on its own CPUs only (the
        process may run on the borrowed ones too, for the workers), and takes the service's
        torch threads, the process's only team (common/server/torch_threads.py)."""
        if self.config.enabled and self.config.own_cpus:
            os.sched_setaffinity(0, self.config.own_cpus)
        if self.config.own_threads > 0:
            take_team(self.config.own_threads)

    def _use(self, threads: int) -> None:
        if threads != self._threads:
            if threads > self.config.own_threads and not self._workers_started:
                self._start_workers(threads)
            torch.set_num_threads(threads)
            self._threads = threads
            if self._counters is not None and threads > self.config.own_threads:
                self._counters.add("core_borrows")

    @property
    def threads(self) -> int:
        return self._threads

    # ---- decode ----
    def decode_state(self, computing: bool, awaiting: bool, own_pass: bool = False) -> None:
        """Decode's engine thread, before it computes (computing) or when it goes idle:
        holds the busy file while computing, and borrows while no handoff awaits KV.
        own_pass: what follows is a prefill pass of decode's own (conditional
        disaggregation), which borrows whenever that is allowed: the guard judges steps, and
        a pass of many rows gains from a second core where a step of a few may not."""
        if not self.config.enabled:
            return
        if computing and self._lock is not None:
            self._lock.try_take()
        elif self._lock is not None:
            self._lock.give_back()
        borrow = computing and not awaiting and (own_pass or self._guard.wants_borrow())
        self._use(self.config.own_threads + (self.config.borrowed_threads if borrow else 0))

    def step_done(self, seconds: float) -> None:
        """Decode's engine thread, after each step: its wall time, for the guard."""
        if self.config.enabled:
            self._guard.step_done(seconds, self._threads > self.config.own_threads)

    # ---- prefill ----
    def _decode_idle(self) -> bool:
        """Whether decode holds no busy file now."""
        return self._lock is not None and not self._lock.held_elsewhere()

    @contextlib.contextmanager
    def prefill_pass(self, num_tokens: int) -> Iterator[None]:
        """Around one prefill pass of num_tokens: borrowed threads if it is long enough and
        decode idles as it starts."""
        if (not self.config.enabled or num_tokens < self.config.min_borrow_tokens
                or not self._decode_idle()):
            yield
            return
        try:
            self._lent.try_take()  # held by decode's probe this instant: speed only, never waited
            self._use(self.config.own_threads + self.config.borrowed_threads)
            yield
        finally:
            self._use(self.config.own_threads)
            self._lent.give_back()

    def prefill_layer(self) -> None:
        """After each layer of a pass: a pass that borrows stops once decode is busy."""
        if self._threads > self.config.own_threads and not self._decode_idle():
            self._use(self.config.own_threads)
            self._lent.give_back()

    # ---- decode, about prefill ----
    def peer_borrowing(self) -> bool:
        """Decode: whether prefill computes a pass on borrowed threads now (it holds the lent
        file)."""
        return self._lent is not None and self._lent.held_elsewhere()

    def close(self) -> None:
        if self._lock is not None:
            try:
                self._lock.close()
            finally:
                self._lent.close()
