"""Page bookkeeping: owners, page tables and written-slot counts. Holds no tensors.

Invariants (checked by `check_invariants`, relied on by every attention path):
- a page is either on the free list or owned by exactly one request, never both, never two;
- a request's page table lists only pages it owns, in token order;
- `written_tokens(owner)` counts the leading tokens of the request whose KV is in place in
  every layer, and never exceeds the slots of its table; attention may read token t of a
  request only when t < written_tokens(owner) (`check_read`), and may write token t only into
  a slot of its own table (`check_write`);
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

    def allocate(self, owner: str, num_tokens: int) -> list[int]:
        """Reserves pages for num_tokens under a new owner; raises PoolExhausted if short.
        Nothing changes when it raises."""
        if num_tokens < 0:
            raise ValueError(f"owner {owner!r} asks for {num_tokens} tokens")
        with self._lock:
            if owner in self._tables:
                raise ValueError(f"owner {owner!r} already holds pages")
            needed = self.pages_needed(num_tokens)
            if needed > len(self._free):
                raise PoolExhausted(f"need {needed} pages, {len(self._free)} free")
            pages = self._free[len(self._free) - needed:][::-1]
            for page in pages:
                if self._owner[page] is not None:  # a corrupt free list; refuse, change nothing
                    raise RuntimeError(f"page {page} is free and owned by {self._owner[page]!r}")
            del self._free[len(self._free) - needed:]
            for page in pages:
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
                if self._owner[page] != owner:
                    raise RuntimeError(
                        f"page {page} of {owner!r} is owned by {self._owner[page]!r}")
                self._owner[page] = None
                self._free.append(page)
            return pages

    def page_table(self, owner: str) -> list[int]:
        with self._lock:
            return list(self._tables[owner])

    def holds(self, owner: str) -> bool:
        with self._lock:
            return owner in self._tables

    def owner_of(self, page: int) -> str | None:
        with self._lock:
            return self._owner[page]

    def mark_written(self, owner: str, num_tokens: int) -> None:
        """Records that the first num_tokens tokens of owner are in place in every layer."""
        with self._lock:
            capacity = len(self._tables[owner]) * self.page_size
            if num_tokens > capacity:
                raise PageOwnershipError(
                    f"{owner}: {num_tokens} tokens exceed its {capacity} slots")
            self._written[owner] = max(self._written[owner], num_tokens)

    def written_tokens(self, owner: str) -> int:
        with self._lock:
            return self._written[owner]

    def check_read(self, owner: str, pages: list[int], num_tokens: int) -> None:
        """Raises PageOwnershipError unless `pages` is the leading part of owner's own page
        table, in order, covers num_tokens, and owner wrote those num_tokens tokens."""
        with self._lock:
            self._check_table(owner, pages)
            if num_tokens > len(pages) * self.page_size:
                raise PageOwnershipError(f"{owner}: reads {num_tokens} tokens from "
                                         f"{len(pages)} pages of {self.page_size}")
            written = self._written.get(owner, 0)
            if num_tokens > written:
                raise PageOwnershipError(
                    f"{owner}: reads {num_tokens} tokens, only {written} written")

    def check_write(self, owner: str, pages: list[int], token: int) -> None:
        """Raises PageOwnershipError unless token's slot lies in owner's own pages."""
        with self._lock:
            self._check_table(owner, pages)
            if not 0 <= token < len(pages) * self.page_size:
                raise PageOwnershipError(f"{owner}: writes token {token} outside its "
                                         f"{len(pages)} pages of {self.page_size}")

    def _check_table(self, owner: str, pages: list[int]) -> None:
        for page in pages:
            if not 0 <= page < self.num_pages or self._owner[page] != owner:
                raise PageOwnershipError(f"{owner}: page {page} is not its own")
        own = self._tables.get(owner, [])
        if list(pages) != own[: len(pages)]:
            raise PageOwnershipError(f"{owner}: page table {list(pages)} is not its own table "
                                     f"{own} in token order")

    def snapshot(self) -> PoolSnapshot:
        with self._lock:
            return PoolSnapshot(self.page_size, self.num_pages, len(self._free))

    def check_invariants(self) -> None:
        """Raises AssertionError when any invariant of the module docstring is broken."""
        with self._lock:
            free = set(self._free)
            if len(free) != len(self._free):
                raise AssertionError("a page is on the free list twice")
            owned = [p for pages in self._tables.values() for p in pages]
            if len(owned) != len(set(owned)):
                raise AssertionError("a page is owned twice")
            if free & set(owned):
                raise AssertionError("a page is both free and owned")
            if len(free) + len(owned) != self.num_pages:
                raise AssertionError("a page is lost")
            for page in free:
                if self._owner[page] is not None:
                    raise AssertionError(f"free page {page} has owner {self._owner[page]!r}")
            for owner, pages in self._tables.items():
                if any(self._owner[p] != owner for p in pages):
                    raise AssertionError(f"{owner}'s table names a page owned by another")
                if not 0 <= self._written[owner] <= len(pages) * self.page_size:
                    raise AssertionError(f"{owner} wrote {self._written[owner]} tokens into "
                                         f"{len(pages)} pages")
            if set(self._written) != set(self._tables):
                raise AssertionError("written counts and page tables name different owners")
