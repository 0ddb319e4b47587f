"""common.handoff.region_pool: a region file comes back for a later handoff only when the peer
released it, under a fresh 0600 name of the region form, truncated to its new size (no byte
past it survives); the pool stays within its bounds, removes everything on close, and sweeps
the directory a dead prefill left."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from common.handoff.region_pool import (POOL_PREFIX, RegionPool, RegionPoolConfig,
                                        sweep_dead_pools)
from common.handoff.shm_region import NAME, RegionError, RegionReader, RegionWriter


def _own(directory):
    """The pool's own directory in directory (there is one while it holds files)."""
    (own,) = [p for p in directory.iterdir() if p.name.startswith(POOL_PREFIX)]
    return own


def _files(own) -> list[str]:
    """The region files in a pool's directory (besides its lock)."""
    return sorted(set(os.listdir(own)) - {"lock"})


def _inode(writer: RegionWriter) -> int:
    return os.stat(writer.path).st_ino


def test_a_released_region_is_reused_under_a_fresh_private_name(tmp_path):
    pool = RegionPool()
    first = RegionWriter(str(tmp_path), 8192, pool)
    first.write(0, np.full(8192, 7, np.uint8))
    inode, name = _inode(first), first.name
    first.close(recycle=True)
    assert not first.path.exists()
    second = RegionWriter(str(tmp_path), 4096, pool)
    assert _inode(second) == inode and pool.reused == 1
    assert second.name != name and NAME.fullmatch(second.name)
    st = os.stat(second.path)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == 4096
    reader = RegionReader(str(tmp_path), second.name)  # decode's checks accept it
    with pytest.raises(RegionError):  # the old handoff's tail is gone
        reader.read_into(4000, np.empty(200, np.uint8))
    reader.close()
    second.close(recycle=True)
    pool.close()
    assert os.listdir(tmp_path) == []


def test_a_region_not_released_by_its_peer_is_removed(tmp_path):
    pool = RegionPool()
    writer = RegionWriter(str(tmp_path), 4096, pool)
    own = _own(tmp_path)
    private = set(_files(own))
    writer.close()  # grace period, shutdown or failure
    assert _files(own) == [] and os.listdir(tmp_path) == [own.name]
    other = RegionWriter(str(tmp_path), 4096, pool)
    assert pool.reused == 0 and not private & set(_files(own))  # a new file
    other.close()
    assert _files(own) == []
    pool.close()
    assert not own.exists()


def test_the_pool_keeps_no_more_than_its_bounds(tmp_path):
    pool = RegionPool(RegionPoolConfig(max_idle=2, max_idle_bytes=10_000))
    writers = [RegionWriter(str(tmp_path), 4096, pool) for _ in range(4)]
    for w in writers:
        w.close(recycle=True)
    own = _own(tmp_path)
    assert len(_files(own)) == 2  # the third and fourth were removed, not kept
    pool.close()


def test_a_dead_prefills_pool_directory_is_swept_and_a_live_ones_kept(tmp_path):
    child = subprocess.run([sys.executable, "-c", (
        "import sys; from common.handoff.region_pool import RegionPool; "
        "from common.handoff.shm_region import RegionWriter; "
        "RegionWriter(sys.argv[1], 4096, RegionPool())")  # exits holding it: as if killed
        , str(tmp_path)], check=True, capture_output=True, cwd=Path(__file__).parents[2])
    assert child.returncode == 0
    dead = [p for p in tmp_path.iterdir() if p.name.startswith(POOL_PREFIX)]
    assert len(dead) == 1 and len(os.listdir(dead[0])) == 2  # its lock and its file
    live = RegionPool()
    writer = RegionWriter(str(tmp_path), 16, live)  # first use: sweeps the dead one
    assert not dead[0].exists()
    assert sweep_dead_pools(str(tmp_path)) == 0  # the live pool's lock is held: kept
    writer.close(recycle=True)
    assert len([p for p in tmp_path.iterdir() if p.name.startswith(POOL_PREFIX)]) == 1
    live.close()
    (left,) = os.listdir(tmp_path)  # the dead one's public region: decode unlinks it (D-65)
    assert NAME.fullmatch(left)


def test_idle_files_and_the_pool_directory_go_when_the_traffic_stops(tmp_path):
    pool = RegionPool(RegionPoolConfig(max_idle_s=0.0))
    held = RegionWriter(str(tmp_path), 4096, pool)
    RegionWriter(str(tmp_path), 4096, pool).close(recycle=True)
    pool.prune()  # one file still out: the directory stays, the idle one goes
    own = _own(tmp_path)
    assert len(_files(own)) == 1
    held.close(recycle=True)
    pool.prune()
    assert os.listdir(tmp_path) == []
    again = RegionWriter(str(tmp_path), 4096, pool)  # the directory is made again
    assert again.path.exists()
    again.close()
    pool.close()
    assert os.listdir(tmp_path) == []


def test_a_pooled_region_is_written_through_its_kept_mapping_within_its_size(tmp_path):
    """Where a reused pooled file's earlier handoff wrote its pages, stores through
    PooledFile.writable are what decode's pread reads, and the view never reaches past the
    handoff's size (a shrunk file); a new file, a grown one and a region of its own have none
    (pwrite allocates the pages)."""
    pool = RegionPool()
    # the same file each time: new, shrunk, grown, then the same size again
    steps = [(8192, 5, False), (4096, 9, True), (16384, 3, False), (16384, 7, True)]
    inodes = set()
    for size, fill, mapped in steps:
        writer = RegionWriter(str(tmp_path), size, pool)
        inodes.add(_inode(writer))
        view = writer.writable()
        if mapped:
            assert view.size == size
            view[:] = fill
        else:
            assert view is None
            writer.write(0, np.full(size, fill, np.uint8))
        reader = RegionReader(str(tmp_path), writer.name)
        got = np.empty(size, np.uint8)
        reader.read_into(0, got)
        assert (got == fill).all()
        with pytest.raises(RegionError):  # nothing past the size, whatever was mapped before
            reader.read_into(size, np.empty(1, np.uint8))
        reader.close()
        writer.close(recycle=True, written=size)
    assert len(inodes) == 1 and pool.reused == 3
    own_region = RegionWriter(str(tmp_path), 4096)
    assert own_region.writable() is None  # pwritev: a fresh mapping costs more than it saves
    own_region.close()
    pool.close()
    assert os.listdir(tmp_path) == []


def test_a_handoff_that_ended_early_leaves_no_mapping_over_its_holes(tmp_path):
    """A file whose last handoff wrote only [0, written) is written by pwritev next time (a
    store through a mapping into a hole of a full tmpfs would be SIGBUS, not ENOSPC)."""
    pool = RegionPool()
    first = RegionWriter(str(tmp_path), 8192, pool)
    first.write(0, np.full(4096, 1, np.uint8))  # refused or cancelled after half of it
    first.close(recycle=True, written=4096)
    second = RegionWriter(str(tmp_path), 8192, pool)
    assert pool.reused == 1 and second.writable() is None
    second.write(0, np.full(8192, 2, np.uint8))
    second.close(recycle=True, written=8192)
    third = RegionWriter(str(tmp_path), 4096, pool)
    assert third.writable() is not None and third.writable().size == 4096
    third.close()
