"""Page bookkeeping: owners, page tables, written-slot counts and shared (cached) pages.
Holds no tensors.

A page is in exactly one of three states: free (on the free list), owned by one request, or
cached: owned by the prefix cache and lent read-only to any number of requests, counted by its
reference count. Invariants (checked by `check_invariants`, relied on by every attention path):
- every page is free, owned by exactly one request, or cached; never two of these, never two
  owners;
- a request's page table lists, in token order, pages it owns and cached pages it borrows; a
  cached page's reference count equals the number of tables that list it, and a table lists a
  page at most once;
- a cached page holds a complete page of KV: in every table that lists it, it lies within the
  request's written tokens;
- `written_tokens(owner)` counts the leading tokens of the request whose KV is in place in
  every layer, and never exceeds the slots of its table; attention may read token t of a
  request only when t < written_tokens(owner) (`check_read`; borrowed pages are readable), and
  may write token t only into a slot of a page the request owns (`check_write` refuses a
  borrowed page: nobody writes a cached page);
- `free` returns the owner's own pages to the free list and drops its borrows; a cached page
  goes back to the free list only through `evict`, and only with reference count 0; a freed
  page's contents are not trusted by anyone.
Every operation that raises changes nothing.
Thread safety: every method takes the pool's lock; callers may query from any thread.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass


class PoolExhausted(RuntimeError):
    """The pool has too few free pages right now."""


class PageOwnershipError(RuntimeError):
    """A page table names a page its request does not own, or a read passes the written slots."""


@dataclass(frozen=True)
class PoolSnapshot:
    """pages_free: on the free list; pages_cached: owned by the prefix cache, of which
    pages_evictable are lent to no request (admission may evict them, so they count as free
    capacity: `pages_available`)."""

    page_size: int
    pages_total: int
    pages_free: int
    pages_cached: int = 0
    pages_evictable: int = 0

    @property
    def pages_available(self) -> int:
        return self.pages_free + self.pages_evictable

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
        self._refs: dict[int, int] = {}  # cached page -> tables that borrow it
        self._tables: dict[str, list[int]] = {}
        self._written: dict[str, int] = {}

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, num_tokens: int, borrowed: int = 0) -> bool:
        """Would `allocate` of num_tokens with `borrowed` cached pages find its own pages free?"""
        with self._lock:
            return self.pages_needed(num_tokens) - borrowed <= len(self._free)

    def allocate(self, owner: str, num_tokens: int, borrowed: Sequence[int] = ()) -> list[int]:
        """Reserves pages for num_tokens under a new owner: its table starts with the cached
        pages `borrowed` (their KV counts as written; each one's reference count goes up), and
        free pages follow for the rest. Raises PoolExhausted if short, PageOwnershipError if a
        borrowed page is not cached. Nothing changes when it raises."""
        if num_tokens < 0:
            raise ValueError(f"owner {owner!r} asks for {num_tokens} tokens")
        borrowed = list(borrowed)
        with self._lock:
            if owner in self._tables:
                raise ValueError(f"owner {owner!r} already holds pages")
            needed = self.pages_needed(num_tokens) - len(borrowed)
            if needed < 0:
                raise ValueError(f"owner {owner!r} borrows {len(borrowed)} pages for "
                                 f"{num_tokens} tokens")
            if len(set(borrowed)) != len(borrowed) or any(p not in self._refs for p in borrowed):
                raise PageOwnershipError(f"{owner}: borrows {borrowed}, not all distinct cached "
                                         "pages")
            if needed > len(self._free):
                raise PoolExhausted(f"need {needed} pages, {len(self._free)} free")
            pages = self._free[len(self._free) - needed:][::-1]
            for page in pages:
                if self._owner[page] is not None:  # a corrupt free list; refuse, change nothing
                    raise RuntimeError(f"page {page} is free and owned by {self._owner[page]!r}")
            del self._free[len(self._free) - needed:]
            for page in pages:
                self._owner[page] = owner
            for page in borrowed:
                self._refs[page] += 1
            self._tables[owner] = borrowed + pages
            self._written[owner] = len(borrowed) * self.page_size
            return borrowed + list(pages)

    def own_pages(self, owner: str) -> list[int]:
        """The pages `free(owner)` would put on the free list (not the borrowed ones)."""
        with self._lock:
            return [p for p in self._tables.get(owner, []) if p not in self._refs]

    def free(self, owner: str) -> list[int]:
        """Returns the owner's own pages to the free list and drops its borrows (no-op for an
        unknown owner); returns the pages that went to the free list."""
        with self._lock:
            table = self._tables.get(owner, [])
            own = [p for p in table if p not in self._refs]
            for page in own:
                if self._owner[page] != owner:
                    raise RuntimeError(
                        f"page {page} of {owner!r} is owned by {self._owner[page]!r}")
            self._tables.pop(owner, None)
            self._written.pop(owner, None)
            # last page first: allocate pops from the end, so the next request gets these pages
            # back in ascending order, and adjacent pages stay adjacent in its page table (a
            # handoff then moves a run of pages as one piece: common.handoff.page_pieces)
            for page in reversed(table):
                if page in self._refs:
                    self._refs[page] -= 1
                else:
                    self._owner[page] = None
                    self._free.append(page)
            return own
    def rename(self, owner: str, new_owner: str) -> None:
        """owner's table, written count and own pages pass to new_owner unchanged, nothing freed
        (pages a late transfer may still write leave their request without reaching the free
        list). Raises KeyError (unknown owner) or ValueError (new_owner holds pages); nothing
        changes when it raises."""
        with self._lock:
            if new_owner in self._tables:
                raise ValueError(f"owner {new_owner!r} already holds pages")
            table = self._tables.pop(owner)
            self._tables[new_owner] = table
            self._written[new_owner] = self._written.pop(owner)
            for page in table:
                if page not in self._refs:
                    self._owner[page] = new_owner

    def page_table(self, owner: str) -> list[int]:
        with self._lock:
            return list(self._tables[owner])

    def holds(self, owner: str) -> bool:
        with self._lock:
            return owner in self._tables

    def owner_of(self, page: int) -> str | None:
        """The request that owns page; None when it is free or cached."""
        with self._lock:
            return self._owner[page]

    def is_cached(self, page: int) -> bool:
        with self._lock:
            return page in self._refs

    def refcount(self, page: int) -> int:
        """How many requests borrow a cached page (0 for a page that is not cached)."""
        with self._lock:
            return self._refs.get(page, 0)

    def give_to_cache(self, owner: str, pages: Sequence[int]) -> None:
        """Ownership of `pages` (owner's own, complete pages of its written tokens) moves to the
        cache, without a copy: owner keeps reading them as borrowed pages (reference count 1).
        Raises PageOwnershipError otherwise; nothing changes when it raises."""
        pages = list(pages)
        with self._lock:
            table = self._tables.get(owner, [])
            complete = table[: self._written.get(owner, 0) // self.page_size]
            for page in pages:
                if page not in complete or self._owner[page] != owner:
                    raise PageOwnershipError(f"{owner}: page {page} is not a complete page of "
                                             "its own written tokens")
            if len(set(pages)) != len(pages):
                raise PageOwnershipError(f"{owner}: gives {pages} to the cache twice")
            for page in pages:
                self._owner[page] = None
                self._refs[page] = 1

    def evict(self, pages: Sequence[int]) -> None:
        """Cached pages no request borrows go back to the free list. Raises PageOwnershipError
        if any page is not cached or is borrowed; nothing changes when it raises."""
        pages = list(pages)
        with self._lock:
            if len(set(pages)) != len(pages):
                raise PageOwnershipError(f"evicts {pages}: a page twice")
            for page in pages:
                if page not in self._refs:
                    raise PageOwnershipError(f"evicts page {page}, which is not cached")
                if self._refs[page]:
                    raise PageOwnershipError(f"evicts page {page}, which {self._refs[page]} "
                                             "requests read")
            for page in pages:
                del self._refs[page]
                self._free.append(page)

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
        table (own or borrowed pages), in order, covers num_tokens, and owner wrote those
        num_tokens tokens."""
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
        """Raises PageOwnershipError unless token's slot lies in a page of owner's table that
        owner owns (a borrowed, cached page is never written)."""
        with self._lock:
            self._check_table(owner, pages)
            if not 0 <= token < len(pages) * self.page_size:
                raise PageOwnershipError(f"{owner}: writes token {token} outside its "
                                         f"{len(pages)} pages of {self.page_size}")
            page = pages[token // self.page_size]
            if self._owner[page] != owner:
                raise PageOwnershipError(f"{owner}: writes token {token} into page {page}, "
                                         "a cached page it only borrows")

    def _check_table(self, owner: str, pages: list[int]) -> None:
        for page in pages:
            if not 0 <= page < self.num_pages or (self._owner[page] != owner
                                                  and page not in self._refs):
                raise PageOwnershipError(f"{owner}: page {page} is not its own")
        own = self._tables.get(owner, [])
        if list(pages) != own[: len(pages)]:
            raise PageOwnershipError(f"{owner}: page table {list(pages)} is not its own table "
                                     f"{own} in token order")

    def snapshot(self) -> PoolSnapshot:
        with self._lock:
            evictable = sum(1 for refs in self._refs.values() if refs == 0)
            return PoolSnapshot(self.page_size, self.num_pages, len(self._free), len(self._refs),
                                evictable)

    def check_invariants(self) -> None:
        """Raises AssertionError when any invariant of the module docstring is broken."""
        with self._lock:
            free = set(self._free)
            if len(free) != len(self._free):
                raise AssertionError("a page is on the free list twice")
            cached = set(self._refs)
            owned = [p for pages in self._tables.values() for p in pages if p not in cached]
            if len(owned) != len(set(owned)):
                raise AssertionError("a page is owned twice")
            if free & set(owned) or free & cached or cached & set(owned):
                raise AssertionError("a page is in two of: free, owned, cached")
            if len(free) + len(owned) + len(cached) != self.num_pages:
                raise AssertionError("a page is lost")
            for state, pages in (("free", free), ("cached", cached)):
                for page in pages:
                    if self._owner[page] is not None:
                        raise AssertionError(f"{state} page {page} has owner "
                                             f"{self._owner[page]!r}")
            borrows = {page: 0 for page in cached}
            for owner, pages in self._tables.items():
                if len(set(pages)) != len(pages):
                    raise AssertionError(f"{owner}'s table lists a page twice")
                if any(self._owner[p] != owner for p in pages if p not in cached):
                    raise AssertionError(f"{owner}'s table names a page owned by another")
                if not 0 <= self._written[owner] <= len(pages) * self.page_size:
                    raise AssertionError(f"{owner} wrote {self._written[owner]} tokens into "
                                         f"{len(pages)} pages")
                complete = self._written[owner] // self.page_size
                for index, page in enumerate(pages):
                    if page in cached:
                        borrows[page] += 1
                        if index >= complete:
                            raise AssertionError(f"{owner} borrows cached page {page} beyond "
                                                 f"its {self._written[owner]} written tokens")
            if borrows != self._refs:
                raise AssertionError("a cached page's reference count is not the number of "
                                     "tables that borrow it")
            if set(self._written) != set(self._tables):
                raise AssertionError("written counts and page tables name different owners")
