"""decode_svc.nixl_pool: which path NIXL READs land through, said once in the log: a CPU pool
is registered with decode's own agent (no metadata for a peer) and read into in place; a pool
elsewhere, or a receiver told so, lands in a staging buffer; a new pool replaces the old
registration, and close deregisters."""

from __future__ import annotations

import torch

from common.kvpool.kv_cache import KvPool, PoolConfig
from decode_svc.nixl_pool import PoolRegistration
from tests.isolation.inproc import RecordingLog
from tests.planes.nixl_env import nixl_or_skip


def _pool(device: str) -> KvPool:
    return KvPool(PoolConfig(pool_tokens=64, page_size=16), 2, 2, 8, torch.bfloat16,
                  torch.device(device))


def test_a_cpu_pool_is_registered_unshared_and_read_into_in_place():
    agent = nixl_or_skip()
    log = RecordingLog()
    reg = PoolRegistration(agent, True, log)
    pool = _pool("cpu")
    reg.register(pool)
    reg.register(pool)  # once per pool
    assert reg.pages is not None and reg.pages.pool is pool
    assert [r.metadata for r in reg._regs] == [b"", b""]  # K and V, nothing for a peer
    assert {r.address for r in reg._regs} == {pool.k.data_ptr(), pool.v.data_ptr()}
    assert [e["path"] for e in log.events("nixl_landing")] == ["pages"]
    other = _pool("cpu")
    reg.register(other)  # a new pool replaces the old registration
    assert reg.pages.pool is other and len(reg._regs) == 2
    assert {r.address for r in reg._regs} == {other.k.data_ptr(), other.v.data_ptr()}
    reg.close()
    assert reg.pages is None and reg._regs == []


def test_a_pool_off_the_cpu_or_a_staging_receiver_lands_in_a_staging_buffer():
    agent = nixl_or_skip()
    log = RecordingLog()
    device_pool = PoolRegistration(agent, True, log)
    device_pool.register(_pool("meta"))  # stands in for a GPU pool: not host pages
    staged = PoolRegistration(agent, False, log)
    staged.register(_pool("cpu"))
    assert device_pool.pages is None and staged.pages is None
    assert device_pool._regs == [] and staged._regs == []
    events = log.events("nixl_landing")
    assert [e["path"] for e in events] == ["staging", "staging"]
    assert "meta" in events[0]["message"] and "configured" in events[1]["message"]
