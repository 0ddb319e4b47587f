"""decode's KV pool registered with decode's own NIXL agent, so READs land straight in a
reservation's pages (SPEC D-67): the K and V tensors of a CPU pool, each one registration,
never described to a peer (no partial metadata is made for them: a peer cannot name them in a
transfer of its own, and decode initiates every READ).

`pages` is the PageLanding to read into, or None where the plane lands in a staging buffer
instead: a pool that is not on the CPU (the engine's write path moves it to the device), a
receiver made with into_pages=False, or a registration NIXL refused. The choice is logged once
per pool (`nixl_landing`). Invariants: registered at most once per pool; deregistered only by
`close`, which the receiver calls when no READ may still land in the pool.
"""

from __future__ import annotations

from common.handoff.nixl_agent import NixlAgent, Registration
from common.handoff.page_pieces import cache_bytes
from common.kvpool.kv_cache import KvPool
from decode_svc.page_landing import PageLanding


class PoolRegistration:
    def __init__(self, agent: NixlAgent, into_pages: bool, log=None) -> None:
        self.agent = agent
        self.into_pages = into_pages
        self.log = log
        self.pages: PageLanding | None = None
        self._pool: KvPool | None = None
        self._regs: list[Registration] = []

    def register(self, pool: KvPool) -> None:
        """Registers pool's K and V (once; a new pool replaces the old one's registration)."""
        if pool is self._pool:
            return
        self.close()
        self._pool = pool
        landing = PageLanding(pool)
        why = ""
        if not self.into_pages:
            why = "configured to land in a staging buffer"
        elif not landing.in_place:
            why = f"the KV pool is on {pool.k.device.type}, not registrable as host pages"
        else:
            try:
                for cache in (pool.k, pool.v):
                    flat = cache_bytes(cache).reshape(-1)  # [L * P * S * row] uint8
                    self._regs.append(self.agent.register_memory(flat.ctypes.data, flat.nbytes))
                self.pages = landing
            except Exception as err:  # NIXL refused the registration: the staging path
                self._deregister()
                why = f"NIXL did not register the pool: {type(err).__name__}: {err}"
        if self.log is not None:
            if self.pages is not None:
                self.log.info("nixl_landing", path="pages",
                              message="NIXL READs land straight in decode's KV pages")
            else:
                self.log.info("nixl_landing", path="staging",
                              message=f"NIXL READs land in a staging buffer: {why}")

    def close(self) -> None:
        self._deregister()
        self._pool, self.pages = None, None

    def _deregister(self) -> None:
        regs, self._regs = self._regs, []
        for reg in regs:
            self.agent.deregister(reg)
