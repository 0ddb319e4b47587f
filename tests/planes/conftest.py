"""Fixtures of the plane tests: an in-process decode engine and a private shm directory."""

from __future__ import annotations

import pytest

from common.kvpool.kv_cache import PoolConfig
from tests.isolation.inproc import Harness


@pytest.fixture
def harness():
    h = Harness(PoolConfig(pool_tokens=256, page_size=16))
    yield h
    h.close()


@pytest.fixture
def shm(tmp_path):
    directory = tmp_path / "shm"
    directory.mkdir(mode=0o700)
    return directory
