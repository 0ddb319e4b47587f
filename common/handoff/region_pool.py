"""Prefill's shared-memory region files kept for reuse: a file a finished handoff used keeps its
tmpfs pages, so the next handoff pays no file creation and no page allocation (writes into a
region written before measured 1.2-1.5x faster than into a fresh one at 64-512 MiB, 2-11x at
2-8 MiB: bench/transfer_fixed_cost.py).

A pooled file has a private name in the pool's own 0700 directory "<dir>/.kvh-pool-<32 hex>"
(decode never opens it: not of the region form, not in its directory's top level) and, per
handoff, a fresh public name "kvh-<32 hex>" linked exclusively by common.handoff.shm_region's
RegionWriter, which decode unlinks as always (D-65). It is truncated to the new handoff's size
before that name exists, and prefill references only bytes the new handoff itself wrote, so no
byte of an earlier handoff is ever referenced (and the checksums cover every byte decode uses).
A file goes back to the pool only when the decode that read it released it (ReleaseHandoff:
it has closed and unlinked it); otherwise (grace period, shutdown, failure) it is removed.

Invariants: at most max_idle idle files and max_idle_bytes per directory; `prune` removes files
idle for max_idle_s and a pool directory left empty (prefill_svc.handoff_leases calls it after
each release); `close` removes every idle file and the pool's directories; the directories of
this user's dead prefills are swept by prefill on first use of a directory and by decode after
a failed handoff (`sweep_dead_pools`: a pool whose lock no live process holds), so a prefill
killed mid-transfer leaves nothing behind once its decode saw the handoff fail.
"""

from __future__ import annotations

import fcntl
import itertools
import mmap
import os
import re
import secrets
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.handoff.shm_region import MODE, RegionError

POOL_PREFIX = ".kvh-pool-"
POOL_NAME = re.compile(r"\.kvh-pool-[0-9a-f]{32}")
LOCK = "lock"  # held (flock) by the pool's process while it lives
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux; elsewhere faults as the stores come


@dataclass(frozen=True)
class RegionPoolConfig:
    max_idle: int = 4  # idle files kept per directory
    max_idle_bytes: int = 1 << 30  # their total size
    max_idle_s: float = 2.0  # an idle file older than this goes at the next prune


@dataclass
class PooledFile:
    """One file of the pool: its descriptor, private name and current size, and, from its first
    reuse, the writable mapping prefill packs through (`writable`), kept with the file so that
    its page faults are paid once per file, not once per handoff (64 MiB, CPU ms: pwrite 40,
    stores through a mapping kept 24, through a fresh one 63, fresh with MAP_POPULATE 37;
    loaded 2-core host).

    Invariant: writable(n) exposes only [0, n) of the file, n <= its current size (a store past
    the end of a shared mapping of a shorter file would fault prefill)."""

    fd: int
    private: Path  # its name in the pool's own directory
    size: int
    idle_since: float = 0.0  # time.monotonic() when it went back to the pool
    mapping: mmap.mmap | None = None  # [mapped] shared, writable; grown by remapping
    backed: int = 0  # bytes an earlier handoff wrote (pages that exist), set when reused
    written: int = 0  # bytes [0, written) its last handoff wrote, set when given back

    def writable(self, n: int) -> np.ndarray | None:
        """[n] uint8, the file's bytes [0, n) through the kept mapping (made or grown here, its
        page tables filled at once: MAP_POPULATE), or None where [0, n) is not all pages an
        earlier handoff of this file wrote (a new file, or one grown): that handoff goes by
        pwritev, which allocates the pages; a mapping would pay faults and allocation both."""
        if not 0 < n <= self.size:
            raise ValueError(f"{n} bytes of a file of {self.size}")
        if n > self.backed:
            self.mapping = None
            return None
        if self.mapping is None or len(self.mapping) < n:
            self.mapping = mmap.mmap(self.fd, n, flags=mmap.MAP_SHARED | _POPULATE)
            # an older, shorter mapping goes with its last view
        return np.frombuffer(self.mapping, np.uint8, n)


class RegionPool:
    """Region files of finished handoffs, kept for the next ones (see the module docstring).
    Thread-safe: taken on the engine thread, given back on the event loop."""

    def __init__(self, config: RegionPoolConfig = RegionPoolConfig()) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._dirs: dict[str, Path] = {}  # shared-memory directory -> the pool's own in it
        self._locks: dict[str, int] = {}  # its lock file's descriptor, flocked
        self._idle: dict[str, list[PooledFile]] = {}
        self._out: dict[str, int] = {}  # files taken and not given back, per directory
        self._serial = itertools.count()
        self.reused = 0  # files taken from the pool (not created)

    def take(self, directory: str, size: int) -> PooledFile:
        """An idle file of directory (the smallest at least size, else the largest), or a new
        one; either way 0600, with its private name only."""
        with self._lock:
            self._out[directory] = self._out.get(directory, 0) + 1
            idle = self._idle.get(directory, [])
            if idle:
                fits = [f for f in idle if f.size >= size]
                chosen = min(fits, key=lambda f: f.size) if fits else max(idle,
                                                                          key=lambda f: f.size)
                idle.remove(chosen)
                chosen.backed = min(chosen.written, chosen.size)  # what its last handoff wrote
                self.reused += 1
                return chosen
            try:
                private = self._own_dir(directory) / str(next(self._serial))
                flags = os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
                fd = os.open(private, flags, MODE)
            except BaseException:
                self._out[directory] -= 1
                raise
        os.fchmod(fd, MODE)
        return PooledFile(fd, private, 0)

    def give(self, directory: str, file: PooledFile, recycle: bool, written: int = 0) -> None:
        """Back to the pool (recycle, and within the bounds), or closed and removed. written:
        the bytes [0, written) its handoff wrote (a handoff that ended early leaves holes past
        them, which a later one must not store into through a mapping: tmpfs allocates a page
        at its first store, and a full tmpfs answers a store with SIGBUS, a pwritev with ENOSPC)."""
        file.written = written
        with self._lock:
            self._out[directory] = self._out.get(directory, 0) - 1
            idle = self._idle.setdefault(directory, [])
            held = sum(f.size for f in idle)
            if (recycle and directory in self._dirs and len(idle) < self.config.max_idle
                    and held + file.size <= self.config.max_idle_bytes):
                file.idle_since = time.monotonic()
                idle.append(file)
                return
        _discard(file)

    def prune(self) -> bool:
        """Removes the files idle for max_idle_s or more, and a directory of the pool's own
        that then holds nothing (traffic stopped: the shared-memory directory is left as it
        was, and the memory is given back). -> whether it still holds a directory (a later
        prune has work to do)."""
        cutoff = time.monotonic() - self.config.max_idle_s
        gone: list[PooledFile] = []
        with self._lock:
            for idle in self._idle.values():
                gone += [f for f in idle if f.idle_since <= cutoff]
                idle[:] = [f for f in idle if f.idle_since > cutoff]
            for file in gone:
                _discard(file)
            for directory, own in list(self._dirs.items()):
                if not self._idle.get(directory) and not self._out.get(directory):
                    _remove_pool_dir(own)
                    os.close(self._locks.pop(directory))
                    del self._dirs[directory]
            return bool(self._dirs)

    def close(self) -> None:
        """Closes and removes every idle file and the pool's directories (shutdown)."""
        with self._lock:
            files = [f for idle in self._idle.values() for f in idle]
            dirs = list(self._dirs.values())
            locks = list(self._locks.values())
            self._idle.clear()
            self._dirs.clear()
            self._locks.clear()
        for file in files:
            _discard(file)
        for own in dirs:
            _remove_pool_dir(own)
        for fd in locks:
            os.close(fd)

    def _own_dir(self, directory: str) -> Path:
        own = self._dirs.get(directory)
        if own is None:
            sweep_dead_pools(directory)
            own, self._locks[directory] = _make_pool_dir(Path(directory))
            self._dirs[directory] = own
        return own


def _make_pool_dir(directory: Path) -> tuple[Path, int]:
    """A new 0700 pool directory holding its lock file, locked (flock) for this process's
    life: built under a name sweeps ignore, renamed once locked, so no sweep can take it for
    a dead prefill's."""
    final = directory / f"{POOL_PREFIX}{secrets.token_hex(16)}"
    building = directory / f".kvh-new-{secrets.token_hex(16)}"
    os.mkdir(building, 0o700)
    fd = os.open(building / LOCK, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW
                 | os.O_CLOEXEC, MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(building, final)
    except BaseException:
        os.close(fd)
        _remove_pool_dir(building)
        raise
    st = os.lstat(final)
    if (not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid()
            or stat.S_IMODE(st.st_mode) & 0o077):
        os.close(fd)
        raise RegionError(f"{final} is not a private directory of this user")
    return final, fd


def _discard(file: PooledFile) -> None:
    file.mapping = None  # unmapped once the last view of it is gone
    os.close(file.fd)
    try:
        os.unlink(file.private)
    except FileNotFoundError:
        pass


def _remove_pool_dir(own: Path) -> None:
    try:
        for entry in os.scandir(own):
            if entry.is_file(follow_symlinks=False):
                os.unlink(entry.path)
        os.rmdir(own)
    except OSError:
        pass


def sweep_dead_pools(directory: str) -> int:
    """Removes the pool directories (and their files) in directory whose prefill is gone:
    this user's, whose lock no live process holds (the kernel drops a flock when its holder
    dies, in any pid namespace). Prefill sweeps on first use of a directory, decode after a
    handoff that failed (a prefill killed mid-transfer). -> directories removed."""
    removed = 0
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return 0
    for entry in entries:
        if not POOL_NAME.fullmatch(entry.name):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(
                    follow_symlinks=False).st_uid != os.geteuid():
                continue
            fd = os.open(Path(entry.path) / LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its prefill is alive
            os.close(fd)
            continue
        _remove_pool_dir(Path(entry.path))
        os.close(fd)
        removed += 1
    return removed
