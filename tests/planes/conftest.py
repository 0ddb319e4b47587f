"""Fixtures of the plane tests: an in-process decode engine, a private shm directory, and for
the NIXL tests decode's agent and receiver."""

from __future__ import annotations

import asyncio

import pytest

from common.counters import Counters
from common.kvpool.kv_cache import PoolConfig
from decode_svc.nixl_receiver import NixlReceiver
from tests.isolation.inproc import Harness
from tests.planes.nixl_env import READ_TIMEOUT_S, nixl_or_skip


@pytest.fixture
def harness():
    h = Harness(PoolConfig(pool_tokens=256, page_size=16))
    yield h
    h.close()


@pytest.fixture(scope="module")
def agent():
    return nixl_or_skip()  # decode's agent, shared by the module (one per process in service)


@pytest.fixture
def receiver(agent):
    """decode's receiver (its quarantine's watcher lives as long as it does)."""
    r = NixlReceiver(None, None, agent, Counters(), READ_TIMEOUT_S)
    yield r
    asyncio.run(r.close())


@pytest.fixture
def shm(tmp_path):
    directory = tmp_path / "shm"
    directory.mkdir(mode=0o700)
    return directory
