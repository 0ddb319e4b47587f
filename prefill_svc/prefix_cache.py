"""The prefix cache on prefill: whole pages of prompt KV, kept after a request and lent
read-only to later requests of the same scope whose prompts start with the same tokens.

Keys: the key of a prompt's page i is SHA-256 over (scope, the key of page i-1, the token ids of
page i), so a hit needs the whole prefix from token 0 and the same scope; an entry also keeps
its scope, parent key and tokens, and a lookup compares all three, so not even a hash collision
can lend a page across scopes or prompts. A request with an empty scope neither looks up nor
inserts: it shares with nobody.

Invariants (`check_invariants`):
- every entry's page is cached in the allocator (ownership moved, never copied), one entry per
  page, and the allocator caches no page without an entry;
- every entry's parent entry exists (eviction takes leaves only), so every entry is reachable
  from token 0 of its scope;
- at most `max_pages` pages are cached.
Eviction takes the least recently used entries that no request reads (reference count 0) and
that have no cached children; it never frees a page a running request reads, and it poisons or
scrubs what it frees (KvPool.evict). Capacity: cached pages no request reads count as free for
admission (`reserve` evicts them to make room), so the cache never refuses a request the pool
could hold without it.

Touched by the engine thread only (like the pool's tensors); `snapshot` is safe from any thread.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from common.counters import Counters
from common.kvpool.kv_cache import KvPool

DOMAIN = b"kvhandoff.prefix-cache.v1"


@dataclass(frozen=True)
class PrefixCacheConfig:
    """enabled: off means every request computes its whole prompt and nothing is kept;
    max_pages: the most pages the cache may own, 0 for as many as the pool has."""

    enabled: bool = True
    max_pages: int = 0


@dataclass(frozen=True)
class CacheSnapshot:
    pages: int
    scopes: int


@dataclass
class _Entry:
    page: int
    parent: bytes | None
    scope: bytes
    tokens: tuple[int, ...]
    children: int = 0


def page_keys(scope: bytes, token_ids: list[int], page_size: int) -> list[bytes]:
    """The chain keys of the prompt's complete pages, page 0 first."""
    keys: list[bytes] = []
    parent = b""
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        h = hashlib.sha256(DOMAIN)
        h.update(len(scope).to_bytes(4, "big") + scope + parent)
        h.update(array("I", token_ids[start:start + page_size]).tobytes())
        parent = h.digest()
        keys.append(parent)
    return keys


def cache_gauges(cache: PrefixCache) -> dict:
    """The cache's Prometheus gauges (ServiceMetrics `gauges`); its events are counters
    (prefix_cache_hits, _misses, _hit_tokens, _unscoped, _pages_inserted, _pages_evicted)."""
    return {"prefix_cache_pages": ("Pool pages the prefix cache owns (read by requests or "
                                   "evictable)", lambda: cache.snapshot().pages),
            "prefix_cache_scopes": ("Cache scopes with at least one cached page (pages are "
                                    "never shared between scopes)",
                                    lambda: cache.snapshot().scopes)}


class PrefixCache:
    def __init__(self, pool: KvPool, config: PrefixCacheConfig, counters: Counters) -> None:
        self.pool = pool
        self.allocator = pool.allocator
        self.config = config
        self.counters = counters
        self.max_pages = config.max_pages or self.allocator.num_pages
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self._scope_pages: dict[bytes, int] = {}

    def reserve(self, owner: str, token_ids: list[int], scope: bytes) -> int | None:
        """Allocates owner's pages for token_ids, borrowing the longest cached prefix of its
        scope (whole pages, always leaving the last token to compute) and evicting unread
        entries when the free list is short. Returns the cached tokens (0 on a miss), or None
        when the pool cannot hold the request now; nothing changes then."""
        if self.allocator.holds(owner):
            raise ValueError(f"owner {owner!r} already holds pages")
        size = self.allocator.page_size
        n = len(token_ids)
        hit: list[int] = []
        keys: list[bytes] = []
        if self.config.enabled and scope:
            keys = page_keys(scope, token_ids[: max(n - 1, 0)], size)
            parent = None
            for i, key in enumerate(keys):
                entry = self._entries.get(key)
                if entry is None or not self._matches(entry, scope, parent,
                                                      token_ids[i * size:(i + 1) * size]):
                    break
                hit.append(entry.page)
                parent = key
        short = self.allocator.pages_needed(n) - len(hit) - self.allocator.snapshot().pages_free
        if short > 0:
            if short > self._evictable(set(hit)):
                return None
            self._evict(short, set(hit))
        self.allocator.allocate(owner, n, hit)
        for key in keys[: len(hit)]:
            self._entries.move_to_end(key)
        if self.config.enabled and scope:
            self.counters.add("prefix_cache_hits" if hit else "prefix_cache_misses")
            self.counters.add("prefix_cache_hit_tokens", len(hit) * size)
        elif self.config.enabled:
            self.counters.add("prefix_cache_unscoped")
        return len(hit) * size

    def insert(self, owner: str, token_ids: list[int], scope: bytes) -> int:
        """After owner's prefill completed (all its prompt KV written): its complete prompt
        pages that the cache does not hold yet become the cache's (ownership moves, no copy),
        up to max_pages, as children of the cached chain they extend. Returns the pages added.

        The chain being extended may be another request's entries that owner never borrowed
        (both missed, the other finished first); eviction to make room keeps that chain, so a
        new entry's parent always exists. Raises only before anything changed."""
        if not (self.config.enabled and scope):
            return 0
        size = self.allocator.page_size
        keys = page_keys(scope, token_ids, size)
        self.allocator.mark_written(owner, len(token_ids))
        first_new = next((i for i, key in enumerate(keys) if key not in self._entries),
                         len(keys))
        chain = keys[:first_new]
        for key in chain:
            self._entries.move_to_end(key)
        wanted = len(keys) - first_new
        over = len(self._entries) + wanted - self.max_pages
        if over > 0:
            self._evict(over, {self._entries[key].page for key in chain})
        count = min(wanted, self.max_pages - len(self._entries))
        if count <= 0:
            return 0
        table = self.allocator.page_table(owner)
        new = range(first_new, first_new + count)
        self.allocator.give_to_cache(owner, [table[i] for i in new])  # raises: nothing changed
        for i in new:
            parent = keys[i - 1] if i else None
            self._entries[keys[i]] = _Entry(table[i], parent, scope,
                                            tuple(token_ids[i * size:(i + 1) * size]))
            if parent is not None:
                self._entries[parent].children += 1
        self._scope_pages[scope] = self._scope_pages.get(scope, 0) + count
        self.counters.add("prefix_cache_pages_inserted", count)
        return count

    def snapshot(self) -> CacheSnapshot:
        return CacheSnapshot(len(self._entries), len(self._scope_pages))

    def check_invariants(self) -> None:
        """Raises AssertionError when an invariant of the module docstring is broken."""
        pages = [entry.page for entry in self._entries.values()]
        if len(pages) != len(set(pages)):
            raise AssertionError("two entries name one page")
        if not all(self.allocator.is_cached(p) for p in pages):
            raise AssertionError("an entry's page is not cached in the allocator")
        if self.allocator.snapshot().pages_cached != len(pages):
            raise AssertionError("the allocator caches a page no entry names")
        if len(pages) > self.max_pages:
            raise AssertionError(f"{len(pages)} pages cached, at most {self.max_pages}")
        children: dict[bytes, int] = {}
        for entry in self._entries.values():
            if entry.parent is not None:
                if entry.parent not in self._entries:
                    raise AssertionError("an entry's parent is gone")
                if self._entries[entry.parent].scope != entry.scope:
                    raise AssertionError("an entry's parent has another scope")
                children[entry.parent] = children.get(entry.parent, 0) + 1
        if any(entry.children != children.get(key, 0) for key, entry in self._entries.items()):
            raise AssertionError("an entry's child count is wrong")

    @staticmethod
    def _matches(entry: _Entry, scope: bytes, parent: bytes | None, tokens: list[int]) -> bool:
        return entry.scope == scope and entry.parent == parent and entry.tokens == tuple(tokens)

    def _evictable(self, keep: set[int]) -> int:
        """Entries `_evict` can take: those with no read or kept page at or below them (a
        request's new pages may hang under another request's unread ones)."""
        pinned: set[bytes] = set()
        for key, entry in self._entries.items():
            if entry.page in keep or self.allocator.refcount(entry.page):
                while key is not None and key not in pinned:
                    pinned.add(key)
                    key = self._entries[key].parent
        return len(self._entries) - len(pinned)

    def _evict(self, count: int, keep: set[int]) -> int:
        """Evicts up to count unread entries, least recently used leaves first (a leaf's parent
        follows it when that leaves the parent an unread leaf), their pages poisoned or
        scrubbed in one fill; returns how many."""
        pages: list[int] = []

        def unread_leaf(key: bytes) -> bool:
            e = self._entries[key]
            return (e.children == 0 and e.page not in keep
                    and self.allocator.refcount(e.page) == 0)

        while len(pages) < count:
            before = len(pages)
            for key in list(self._entries):
                if len(pages) >= count:
                    break
                while (key is not None and key in self._entries and len(pages) < count
                       and unread_leaf(key)):
                    entry = self._drop(key)
                    pages.append(entry.page)
                    key = entry.parent
            if len(pages) == before:
                break
        if pages:
            self.pool.evict(pages)
            self.counters.add("prefix_cache_pages_evicted", len(pages))
        return len(pages)

    def _drop(self, key: bytes) -> _Entry:
        """Removes one entry (its page is evicted by the caller)."""
        entry = self._entries.pop(key)
        if entry.parent is not None:
            self._entries[entry.parent].children -= 1
        left = self._scope_pages[entry.scope] - 1
        if left:
            self._scope_pages[entry.scope] = left
        else:
            del self._scope_pages[entry.scope]
        return entry
