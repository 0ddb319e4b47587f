"""Page bookkeeping: owners, page tables and written-slot counts. Holds no tensors.

Invariants (checked by `check_invariants`, relied on by every attention path):
- a page is either on the free list or owned by exactly one request, never both, never two;
- a request's page table lists only pages it owns, in token order;
- `written_tokens(owner)` counts the leading tokens of the request whose KV is in place in
  every layer; attention may read token t of a request only when t < written_tokens(owner);
- `free` returns every page of the owner; a freed page's contents are not trusted by anyone.
Thread safety: every method takes the pool's lock; callers may query from any thread.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


class PoolExhausted(RuntimeError):
    """The pool has too few free pages right now."""


class PageOwnershipError(RuntimeError):
    """A page table names a page its request does not own, or a read passes the written slots."""


@dataclass(frozen=True)
class PoolSnapshot:
    page_size: int
    pages_total: int
    pages_free: int

    @property
    def tokens_total(self) -> int:
        return self.pages_total * self.page_size


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"pool needs >= 1 page of >= 1 slot, got {num_pages} x {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._lock = threading.Lock()
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out page 0 first
        self._owner: list[str | None] = [None] * num_pages
        self._tables: dict[str, list[int]] = {}
        self._written: dict[str, int] = {}

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, num_tokens: int) -> bool:
        with self._lock:
            return self.pages_needed(num_tokens) <= len(self._free)

    def can_ever_allocate(self, num_tokens: int) -> bool:
        """True when an empty pool could hold num_tokens."""
        return self.pages_needed(num_tokens) <= self.num_pages

    def allocate(self, owner: str, num_tokens: int) -> list[int]:
        """Reserves pages for num_tokens under a new owner; raises PoolExhausted if short."""
        with self._lock:
            if owner in self._tables:
                raise ValueError(f"owner {owner!r} already holds pages")
            needed = self.pages_needed(num_tokens)
            if needed > len(self._free):
                raise PoolExhausted(f"need {needed} pages, {len(self._free)} free")
            pages = [self._free.pop() for _ in range(needed)]
            for page in pages:
                assert self._owner[page] is None, f"page {page} handed out twice"
                self._owner[page] = owner
            self._tables[owner] = pages
            self._written[owner] = 0
            return list(pages)

    def free(self, owner: str) -> list[int]:
        """Returns the owner's pages to the free list (no-op for an unknown owner)."""
        with self._lock:
            pages = self._tables.pop(owner, [])
            self._written.pop(owner, None)
            for page in pages:
                assert self._owner[page] == owner
                self._owner[page] = None
                self._free.append(page)
            return pages

    def page_table(self, owner: str) -> list[int]:
        with self._lock:
            return list(self._tables[owner])

    def holds(self, owner: str) -> bool:
        with self._lock:
            return owner in self._tables

    def mark_written(self, owner: str, num_tokens: int) -> None:
        """Records that the first num_tokens tokens of owner are in place in every layer."""
        with self._lock:
            capacity = len(self._tables[owner]) * self.page_size
            if num_tokens > capacity:
                raise PageOwnershipError(f"{owner}: {num_tokens} tokens exceed its {capacity} slots")
            self._written[owner] = max(self._written[owner], num_tokens)

    def written_tokens(self, owner: str) -> int:
        with self._lock:
            return self._written[owner]

    def check_read(self, owner: str, pages: list[int], num_tokens: int) -> None:
        """Raises PageOwnershipError unless owner owns every page and wrote the num_tokens read."""
        with self._lock:
            for page in pages:
                if not 0 <= page < self.num_pages or self._owner[page] != owner:
                    raise PageOwnershipError(f"{owner}: page {page} is not its own")
            if num_tokens > self._written.get(owner, 0):
                raise PageOwnershipError(
                    f"{owner}: reads {num_tokens} tokens, only {self._written.get(owner, 0)} written")

    def snapshot(self) -> PoolSnapshot:
        with self._lock:
            return PoolSnapshot(self.page_size, self.num_pages, len(self._free))

    def check_invariants(self) -> None:
        with self._lock:
            free = set(self._free)
            assert len(free) == len(self._free), "a page is on the free list twice"
            owned = [p for pages in self._tables.values() for p in pages]
            assert len(owned) == len(set(owned)), "a page is owned twice"
            assert not free & set(owned), "a page is both free and owned"
            assert len(free) + len(owned) == self.num_pages, "a page is lost"
