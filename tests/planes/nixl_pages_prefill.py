"""A real prefill service in its own process for the NIXL page-lease tests (SPEC P-68): the
PrefillEngine over the tiny random model of tests.isolation.inproc (seed 0, so a decode
Harness in the test's process computes the same model), its pool poisoned on free (unless the
spec says not to) and checked for owners, a prefix cache, and the real HandoffServicer
offering NIXL with its own agent, on a gRPC server at 127.0.0.1:0.

Commands over a multiprocessing pipe: ("stats",) -> {pages_free, pages_available,
pages_cached, waiting, counters}; ("fragment", n) -> True: n one-page owners taken and every
other one freed again, so the next reservations get non-adjacent pages; ("exit",).
"""

from __future__ import annotations

import asyncio
import io
import multiprocessing as mp
from dataclasses import dataclass

from tests.planes.nixl_env import use_loopback_ucx

FINGERPRINT = "fp"
PAGE_SIZE = 16


@dataclass(frozen=True)
class PagesPrefillSpec:
    pool_tokens: int = 256
    release_grace_s: float = 30.0
    lease_enabled: bool = True
    lease_max_pages: int = 0
    prefill_chunk_tokens: int = 2048  # less: a prompt's KV over several passes
    poison_freed: bool = True  # False: freed pages keep their KV (the P-68a scrub runs)


async def _serve(conn, spec: PagesPrefillSpec) -> None:
    import torch

    from common.capacity import Capacity
    from common.counters import Counters
    from common.handoff.layout import DEFAULT_MAX_CHUNK_BYTES, KvLayout
    from common.handoff.nixl_agent import open_agent
    from common.kvpool.kv_cache import KvPool, PoolConfig
    from common.log import make_logger
    from common.server.grpc_server import create_server, set_serving
    from prefill_svc.engine import PrefillEngine
    from prefill_svc.nixl_sender import NixlPlane
    from prefill_svc.page_lease import PageLeaseConfig
    from prefill_svc.prefix_cache import PrefixCache, PrefixCacheConfig
    from prefill_svc.send_budget import SendBudget
    from prefill_svc.servicer import HandoffServicer, PlaneOffer, add_handoff_service
    from prefill_svc.validation import PrefillLimits
    from tests.isolation.inproc import tiny_model

    agent, why = open_agent("prefill", loopback=True)
    if agent is None:
        conn.send(why)
        return
    model = tiny_model()
    c = model.config
    layout = KvLayout(c.num_layers, c.num_kv_heads, c.head_dim, torch.float32)
    pool = KvPool(PoolConfig(spec.pool_tokens, PAGE_SIZE, poison_freed=spec.poison_freed,
                             check_owners=True),
                  c.num_layers, c.num_kv_heads, c.head_dim, torch.float32, torch.device("cpu"))
    counters = Counters()
    log = make_logger("prefill", stream=io.StringIO())
    cache = PrefixCache(pool, PrefixCacheConfig(True), counters)
    engine = PrefillEngine(model, pool, layout, spec.pool_tokens, log, counters,
                           SendBudget(64 << 20), prefill_chunk_tokens=spec.prefill_chunk_tokens,
                           prefix_cache=cache)
    nixl = NixlPlane(agent)
    planes = PlaneOffer(release_grace_s=spec.release_grace_s, nixl=nixl,
                        page_lease=PageLeaseConfig(spec.lease_enabled, spec.lease_max_pages))
    capacity = Capacity(PAGE_SIZE, pool.allocator.num_pages, layout.kv_bytes_per_token,
                        spec.pool_tokens, "test")
    limits = PrefillLimits(vocab_size=c.vocab_size, context_window=spec.pool_tokens,
                           pool_tokens=spec.pool_tokens, model_fingerprint=FINGERPRINT,
                           min_chunk_bytes=layout.kv_bytes_per_token_per_layer,
                           data_planes=planes.served())
    servicer = HandoffServicer(engine, layout, capacity, limits, Counters(), log, planes=planes)
    name = "kvhandoff.v1.HandoffService"

    def register(server) -> list[str]:
        add_handoff_service(servicer, server)
        return [name]

    server, port, health = await create_server(register, "127.0.0.1", 0, None,
                                               DEFAULT_MAX_CHUNK_BYTES + (1 << 20))
    engine.start()
    await set_serving(health, [name], True)
    conn.send(port)
    loop = asyncio.get_running_loop()
    while True:
        command, *args = await loop.run_in_executor(None, conn.recv)
        if command == "stats":
            snap = pool.allocator.snapshot()
            conn.send({"pages_free": snap.pages_free, "pages_available": snap.pages_available,
                       "pages_cached": snap.pages_cached, "waiting": engine.waiting_count(),
                       "counters": counters.snapshot()})
        elif command == "fragment":
            owners = [f"fragment-{i}" for i in range(args[0])]
            for owner in owners:
                pool.allocator.allocate(owner, PAGE_SIZE)
            for owner in owners[::2]:
                pool.allocator.free(owner)
            conn.send(True)
        else:
            break
    await server.stop(0)
    servicer.leases.close()
    engine.stop()
    nixl.close()


def _main(conn, spec: PagesPrefillSpec) -> None:
    use_loopback_ucx()
    asyncio.run(_serve(conn, spec))


class PagesPrefill:
    """The service process; `why` is set (and `port` 0) when NIXL cannot start there."""

    def __init__(self, spec: PagesPrefillSpec = PagesPrefillSpec()) -> None:
        self._conn, child = mp.Pipe()
        self.proc = mp.get_context("spawn").Process(target=_main, args=(child, spec),
                                                     daemon=True)
        self.proc.start()
        if not self._conn.poll(120):
            self.close()
            raise RuntimeError("the NIXL pages prefill did not start within 120 s")
        answer = self._conn.recv()
        self.why, self.port = (answer, 0) if isinstance(answer, str) else ("", answer)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def ask(self, *command):
        self._conn.send(command)
        return self._conn.recv()

    def stats(self) -> dict:
        return self.ask("stats")

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self._conn.send(("exit",))
            except OSError:
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
