"""Shared-memory regions for the shared-memory data plane: prefill writes, decode copies out.

A region is one regular file in the shared-memory directory (/dev/shm by default) named "kvh-"
plus 32 random hex digits (128 bits from `secrets`: unguessable), created exclusively with mode
0600, never following a link. Decode opens only names of that exact form inside its own
configured directory, only regular files owned by its own user with no group or other access,
and reads them with pread into memory it owns (never a mapping: a region the peer truncates or
rewrites cannot fault decode or change bytes after they were checked).

A writer may take its file from a RegionPool (common.handoff.region_pool): a file of a finished
handoff, with a fresh public name per handoff, mode 0600 like any region.

Invariants: the writer's bytes at [offset, offset + n) are final once `write` returns; `close`
unlinks the public name (before a pooled file goes back) and is idempotent; a reader never
returns fewer bytes than asked (it raises RegionError instead).
"""

from __future__ import annotations

import os
import re
import secrets
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from common.handoff.scattered import ScatteredBytes

if TYPE_CHECKING:
    from common.handoff.region_pool import PooledFile, RegionPool

IOV_MAX = 1024  # Linux's limit on the buffers of one preadv
NAME = re.compile(r"kvh-[0-9a-f]{32}")
MODE = 0o600


class RegionError(Exception):
    """A region that does not exist, is not safe to read, or is shorter than a reference says."""


def new_region_name() -> str:
    return f"kvh-{secrets.token_hex(16)}"


class RegionWriter:
    """Prefill's side: one region of `size` bytes, written at offsets, its name unlinked by
    close(); with a pool, its file comes from the pool and goes back to it on close(recycle)."""

    def __init__(self, directory: str, size: int, pool: RegionPool | None = None) -> None:
        self.directory = directory
        self._pool = pool
        self._pooled: PooledFile | None = None
        self.name = new_region_name()
        self.path = Path(directory) / self.name
        if pool is None:
            flags = os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
            self._fd = os.open(self.path, flags, MODE)
        else:
            self._pooled = pool.take(directory, size)
            self._fd = self._pooled.fd
        try:
            os.fchmod(self._fd, MODE)  # whatever the umask
            os.ftruncate(self._fd, size)  # a pooled file: its tail beyond size is gone
            if self._pooled is not None:
                self._pooled.size = size
                os.link(self._pooled.private, self.path)  # exclusive: never replaces a name
        except BaseException:
            self.close()
            raise
        self.size = size

    def writable(self):
        """A pooled region's bytes [0, size) as a writable uint8 array (stores through the pooled
        file's kept mapping: common.handoff.region_pool.PooledFile.writable), final once stored;
        None for a region of its own, or a pooled file's bytes no earlier handoff wrote (pwrite
        into new pages beats a fresh mapping of them)."""
        return None if self._pooled is None else self._pooled.writable(self.size)

    def write(self, offset: int, data) -> None:
        """data: a C-contiguous buffer (bytes, uint8 numpy array), or ScatteredBytes (its pieces
        in order, one pwritev per IOV_MAX of them)."""
        pieces = data.pieces if isinstance(data, ScatteredBytes) else (data,)
        views = [memoryview(p).cast("B") for p in pieces]
        end = offset + sum(len(v) for v in views)
        if offset < 0 or end > self.size:
            raise ValueError(f"write [{offset}, {end}) outside {self.size} bytes")
        while views:
            n = os.pwritev(self._fd, views[:IOV_MAX], offset)
            offset += n
            _advance(views, n)

    def close(self, recycle: bool = False, written: int = 0) -> None:
        """Unlinks the public name; the file is closed, or with a pool given back to it
        (recycle: the peer that read it said it is done, so it may serve a later handoff;
        written: the bytes [0, written) this handoff wrote, RegionPool.give)."""
        try:
            os.unlink(self.path)  # first: a recycled file is never reachable by this name
        except FileNotFoundError:
            pass
        if self._fd >= 0:
            if self._pooled is not None:
                self._pool.give(self.directory, self._pooled, recycle, written)
            else:
                os.close(self._fd)
            self._fd = -1


class RegionReader:
    """Decode's side: opens a region by name in its own directory after the safety checks."""

    def __init__(self, directory: str, name: str) -> None:
        if not NAME.fullmatch(name):
            raise RegionError(f"region name {name[:80]!r} is not of the form kvh-<32 hex digits>")
        path = Path(directory) / name
        try:
            self._fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as err:
            raise RegionError(f"region {name} cannot be opened: {err.strerror}") from err
        st = os.fstat(self._fd)
        problem = ("is not a regular file" if not stat.S_ISREG(st.st_mode)
                   else "belongs to another user" if st.st_uid != os.geteuid()
                   else f"has mode {stat.S_IMODE(st.st_mode):o}, not 600"
                   if stat.S_IMODE(st.st_mode) & 0o077 else "")
        if problem:
            self.close()
            raise RegionError(f"region {name} {problem}")
        self.name = name
        self.path = path

    def unlink(self) -> None:
        """Removes the region's name (the bytes go once no process maps or holds them)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def read_into(self, offset: int, out) -> None:
        """Fills the writable buffer out (len(out) bytes) from [offset, offset + len(out))."""
        self.scatter_into(offset, [out])

    def scatter_into(self, offset: int, pieces: list) -> None:
        """Fills the writable buffers pieces, in order, from the bytes at [offset, offset + their
        total length): one preadv per call where the file is long enough."""
        views = [memoryview(p).cast("B") for p in pieces]
        total = sum(len(v) for v in views)
        end = offset + total
        if 0 < len(views) <= IOV_MAX and os.preadv(self._fd, views, offset) == total:
            return  # the usual case (a block of decode's landing pass): one preadv, done
        while views:  # from the start again: a short read may have been a region shrinking
            n = os.preadv(self._fd, views[:IOV_MAX], offset)
            if n <= 0:
                raise RegionError(f"region {self.name} ends before byte {end}")
            offset += n
            _advance(views, n)

    def close(self) -> None:
        if getattr(self, "_fd", -1) >= 0:
            os.close(self._fd)
            self._fd = -1


def _advance(views: list[memoryview], n: int) -> None:
    """Drops the first n bytes of views (a partial read or write), in place."""
    while views and n >= len(views[0]):
        n -= len(views[0])
        views.pop(0)
    if n:
        views[0] = views[0][n:]
