"""The KV tensors of a pool and what happens to a page's bytes when it is freed."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.kvpool.allocator import PageAllocator


@dataclass(frozen=True)
class PoolConfig:
    """page_size in tokens; pool_tokens is rounded down to whole pages.
    poison_freed fills freed pages with NaN (tests: any read of freed KV turns logits NaN);
    scrub_freed zeroes them (operators: no tenant's KV outlives its request in memory); with
    both, poison wins. check_owners verifies every batch's page table against the owners before
    each step."""

    pool_tokens: int
    page_size: int = 16
    poison_freed: bool = False
    scrub_freed: bool = False
    check_owners: bool = False

    @property
    def num_pages(self) -> int:
        return self.pool_tokens // self.page_size


class KvPool:
    """Pages of K and V for every layer: k, v: [num_layers, num_pages, page_size, Hkv, D].

    Owned by one engine thread: tensors are touched only there, with one exception: an
    out-of-band plane lands a handoff's bytes in the pages of that handoff's own reservation
    from the event loop (decode_svc.page_landing), before any engine command reads them and
    before the reservation can be released. The allocator may be queried from anywhere."""

    def __init__(self, config: PoolConfig, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.config = config
        self.allocator = PageAllocator(config.num_pages, config.page_size)
        shape = (num_layers, config.num_pages, config.page_size, num_kv_heads, head_dim)
        fill = float("nan") if config.poison_freed else 0.0
        self.k = torch.full(shape, fill, dtype=dtype, device=device)
        self.v = torch.full(shape, fill, dtype=dtype, device=device)

    @property
    def page_size(self) -> int:
        return self.config.page_size

    def release(self, owner: str) -> None:
        """Frees owner's pages, poisoning or scrubbing their bytes first when configured. Only
        the pages that go back to the free list are filled: cached pages owner borrowed keep
        their KV for the other requests that read them."""
        self._fill(self.allocator.own_pages(owner))
        self.allocator.free(owner)

    def evict(self, pages: list[int]) -> None:
        """Cached pages no request reads go back to the free list, poisoned or scrubbed when
        configured. The allocator refuses first (nothing filled) if any page is borrowed; the
        fill is queued on the engine's stream, by the engine thread, before that thread can
        hand the pages out again, so the next owner's writes land after it."""
        self.allocator.evict(pages)
        self._fill(pages)

    def _fill(self, pages: list[int]) -> None:
        if pages and (self.config.poison_freed or self.config.scrub_freed):
            index = torch.tensor(pages, device=self.k.device)
            value = float("nan") if self.config.poison_freed else 0.0
            # queued on the engine's stream before the pages reach the free list, so the next
            # owner's writes (same stream) land after the fill
            self.k.index_fill_(1, index, value)
            self.v.index_fill_(1, index, value)

    def slots_for(self, pages: list[int], token_start: int, token_end: int) -> list[int]:
        return self.slots_at(pages, range(token_start, token_end))

    def slots_at(self, pages: list[int], positions) -> list[int]:
        """The slot of each token position of a sequence whose pages are `pages`."""
        s = self.page_size
        return [pages[t // s] * s + t % s for t in positions]
