"""The scrub before a handoff's pages are registered for the peer to READ (SPEC P-68a).

NixlPagesSender registers all of a handoff's slots (tokens [0, n) of every layer) on its first
chunk, while most of them are not written yet: later layers of the first pass, every layer of a
chunked prefill's later passes. A page is not cleared when it is freed unless the pool is
configured to (PoolConfig.poison_freed / scrub_freed), so those slots would still hold whatever
request last owned the page, readable by the peer for as long as the registration lasts. The
scrub zeroes them first, so every registered slot holds zeros or this request's own KV.

Which slots hold this request's KV at the first chunk (the engine calls `spans` first for layer
0 of the handoff's first pass, after that layer's KV of the pass is stored; the model stores
layer l + 1 only after on_layer_stored(l) returns: a model that stored ahead would see those
layers zeroed, which decode's depth check refuses, failing closed, never leaking):
- tokens [0, written) in every layer, written = the allocator's `written_tokens(owner)`: the
  cached prefix the request borrows (prefill_svc.prefix_cache: whole pages of the same scope
  and the same leading tokens, complete in every layer, so they are this request's own prefix
  KV; nobody writes a cached page, and the scrub never touches one: they lie within written);
- layer 0's tokens [written, first_end): the first pass just stored them.
Everything else in [0, n) lies in pages the request owns and is zeroed: layers 1.. from
`written`, layer 0 from `first_end`. Skipped when the pool fills freed pages itself (a page
reaches the free list only through KvPool.release / evict, which fill it, or the pool's
initial fill): those slots then hold zeros or NaN already.

Invariant: after `scrub_unwritten`, no slot of tokens [0, n) of the request holds bytes another
request wrote. Engine thread only (it owns the pool's tensors).
"""

from __future__ import annotations

import ctypes

from common.handoff.page_pieces import slot_runs
from common.kvpool.kv_cache import KvPool


def pool_fills_freed_pages(pool: KvPool) -> bool:
    return pool.config.poison_freed or pool.config.scrub_freed


def scrub_unwritten(pool: KvPool, owner: str, table: list[int], num_tokens: int,
                    first_end: int) -> int | None:
    """Zeroes owner's slots not written yet (see the module docstring) -> bytes zeroed, or None
    (nothing zeroed, nothing may be registered) when owner no longer holds its pages: what it
    had written is unknown then, and its table's first pages may be the prefix cache's, shared.
    table: owner's page table; first_end: the end of the tokens layer 0's first chunk covers."""
    if pool_fills_freed_pages(pool):
        return 0
    if not pool.allocator.holds(owner):
        return None
    size = pool.page_size
    written = min(pool.allocator.written_tokens(owner), num_tokens)
    layer0_from = min(max(written, first_end), num_tokens)
    later = slot_runs(table, size, written, num_tokens)
    layer0 = slot_runs(table, size, layer0_from, num_tokens)
    zeroed = 0
    for cache in (pool.k, pool.v):  # [L, P, S, Hkv, D], contiguous host memory
        if cache.device.type != "cpu" or not cache.is_contiguous():
            raise ValueError("only a contiguous host pool's pages can be zeroed by memset")
        row = cache[0, 0, 0].nbytes  # one slot of one layer
        layer_bytes = cache[0].nbytes
        for layer in range(cache.shape[0]):
            # libc's memset per run: torch's zero_ on these slices runs on its thread pool,
            # measured 0.1 GB/s on a loaded 2-core host against memset's ~10 GB/s
            for first, end in (layer0 if layer == 0 else later):
                ctypes.memset(cache.data_ptr() + layer * layer_bytes + first * row, 0,
                              (end - first) * row)
                zeroed += (end - first) * row
    return zeroed
