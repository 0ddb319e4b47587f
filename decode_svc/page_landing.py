"""Where a chunk of one reservation's KV lies in a CPU pool: byte views of the page slots of its
token range, so that an out-of-band plane reads the referenced bytes straight into the pages
(one copy, no staging buffer, no second copy by the engine).

The pages are decode's own memory, reserved for this request alone: the verifier's checksums and
the finiteness check then run over them, and a refused handoff frees them as always (G-07), so
nothing that landed is ever read. The views are written on the event loop while the engine
thread runs other requests: no engine command touches a reservation's pages before its Verify,
which is queued only after the handoff's last chunk landed (KvPool's one exception).

Invariants: views are made only for a layer and token range inside the reservation (callers
bound them first, `in_range`); pieces follow token order, K and V apart, contiguous slots merged.
"""

from __future__ import annotations

import numpy as np
import torch

from common.handoff.scattered import ScatteredBytes
from common.kvpool.kv_cache import KvPool


class PageLanding:
    def __init__(self, pool: KvPool) -> None:
        self.pool = pool
        self.in_place = pool.k.device.type == "cpu"  # elsewhere the engine's write path
        k, v = pool.k, pool.v  # [L, P, S, Hkv, D]
        self._row = k.shape[3] * k.shape[4] * k.element_size()  # bytes per token slot
        if self.in_place:
            self._k, self._v = _bytes(k), _bytes(v)  # [L, P * S * row] uint8, made once

    def in_range(self, layer: int, token_start: int, token_end: int, token_count: int) -> bool:
        return 0 <= layer < self.pool.k.shape[0] and 0 <= token_start < token_end <= token_count

    def pieces(self, request_id: str, layer: int, token_start: int, token_end: int
               ) -> tuple[ScatteredBytes, ScatteredBytes]:
        """K and V of tokens [token_start, token_end) of layer in request_id's pages."""
        table = self.pool.allocator.page_table(request_id)
        size = self.pool.page_size
        if token_end > len(table) * size:
            raise ValueError(f"tokens up to {token_end} do not fit {len(table)} pages")
        runs: list[tuple[int, int]] = []  # [first slot, end slot) in pool order
        token = token_start
        while token < token_end:
            page, offset = table[token // size], token % size
            count = min(size - offset, token_end - token)
            first = page * size + offset
            if runs and runs[-1][1] == first:
                runs[-1] = (runs[-1][0], first + count)
            else:
                runs.append((first, first + count))
            token += count
        row, nbytes = self._row, (token_end - token_start) * self._row
        return tuple(ScatteredBytes(tuple(cache[layer][a * row:b * row] for a, b in runs), nbytes)
                     for cache in (self._k, self._v))


def _bytes(cache) -> np.ndarray:
    """cache [L, P, S, Hkv, D] contiguous on the CPU -> [L, P * S * row] uint8, the same memory."""
    assert cache.is_contiguous()
    return cache.view(torch.uint8).numpy().reshape(cache.shape[0], -1)
