"""Where a chunk of one reservation's KV lies in a CPU pool, for an out-of-band plane that reads
the referenced bytes straight into the pages (one copy, no staging buffer, no second copy by
the engine): common.handoff.page_pieces over the request's page table.

The pages are decode's own memory, reserved for this request alone: the verifier's checksums and
the finiteness check then run over them, and a refused handoff frees them as always (G-07), so
nothing that landed is ever read. The views are written on the event loop while the engine
thread runs other requests: no engine command touches a reservation's pages before its Verify,
which is queued only after the handoff's last chunk landed, and the reservation is released
only after its handoff ended (KvPool's one exception).

Invariants: views are made only for a layer and token range inside the reservation (callers
bound them first, `in_range`).
"""

from __future__ import annotations

from common.handoff.page_pieces import KvPieces, cache_bytes, kv_pieces
from common.kvpool.kv_cache import KvPool


class PageLanding:
    def __init__(self, pool: KvPool) -> None:
        self.pool = pool
        self.in_place = pool.k.device.type == "cpu"  # elsewhere the engine's write path
        k = pool.k  # [L, P, S, Hkv, D]
        self._row = k.shape[3] * k.shape[4] * k.element_size()  # bytes per token slot
        if self.in_place:
            self._k, self._v = cache_bytes(pool.k), cache_bytes(pool.v)  # [L, P * S * row]

    def in_range(self, layer: int, token_start: int, token_end: int, token_count: int) -> bool:
        return 0 <= layer < self.pool.k.shape[0] and 0 <= token_start < token_end <= token_count

    def pieces(self, request_id: str, layer: int, token_start: int, token_end: int) -> KvPieces:
        """K and V of tokens [token_start, token_end) of layer in request_id's pages."""
        return kv_pieces(self._k[layer], self._v[layer], self._row,
                         self.pool.allocator.page_table(request_id), self.pool.page_size,
                         token_start, token_end)
