"""The prefix cache's bookkeeping: whole pages, keyed by scope and the whole prefix, LRU eviction
of unread leaves only, the cap, and random workloads that keep its and the pool's invariants."""

from __future__ import annotations

import random

import pytest
import torch

from common.counters import Counters
from common.kvpool.kv_cache import KvPool, PoolConfig
from prefill_svc.prefix_cache import PrefixCache, PrefixCacheConfig, page_keys

PAGE = 4


def _cache(pages: int = 16, max_pages: int = 0, enabled: bool = True, poison: bool = False
           ) -> PrefixCache:
    pool = KvPool(PoolConfig(pool_tokens=pages * PAGE, page_size=PAGE, poison_freed=poison),
                  num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                  device=torch.device("cpu"))
    return PrefixCache(pool, PrefixCacheConfig(enabled, max_pages), Counters())


def _run(cache: PrefixCache, owner: str, tokens: list[int], scope: bytes) -> int:
    """One request: reserve, 'compute', hand its pages to the cache, release. Returns the
    cached tokens it started from."""
    start = cache.reserve(owner, tokens, scope)
    assert start is not None
    cache.insert(owner, tokens, scope)
    cache.pool.release(owner)
    cache.check_invariants()
    cache.allocator.check_invariants()
    return start


def test_a_second_request_of_the_scope_reuses_whole_pages_only():
    cache = _cache()
    prompt = list(range(10, 21))  # 11 tokens: pages 0 and 1 complete
    assert _run(cache, "a", prompt, b"t") == 0
    assert cache.snapshot().pages == 2
    assert _run(cache, "b", prompt, b"t") == 8
    assert _run(cache, "c", prompt[:9] + [99, 98], b"t") == 8
    assert _run(cache, "d", prompt[:7] + [99, 98], b"t") == 4  # page 1 differs
    assert _run(cache, "e", [1] + prompt[1:], b"t") == 0  # token 0 differs: no page matches
    counters = cache.counters.snapshot()
    assert counters["prefix_cache_hits"] == 3 and counters["prefix_cache_misses"] == 2
    assert counters["prefix_cache_hit_tokens"] == 20


def test_the_last_token_is_always_computed():
    cache = _cache()
    prompt = list(range(10, 18))  # exactly two pages
    _run(cache, "a", prompt, b"t")
    assert _run(cache, "b", prompt, b"t") == 4  # not 8: the last token's logits are needed


def test_scopes_never_share_and_the_empty_scope_shares_with_nobody():
    cache = _cache()
    prompt = list(range(10, 23))
    _run(cache, "a", prompt, b"tenant-a")
    assert _run(cache, "b", prompt, b"tenant-b") == 0
    assert cache.snapshot().pages == 6 and cache.snapshot().scopes == 2
    before = cache.snapshot()
    assert _run(cache, "c", prompt, b"") == 0
    assert cache.snapshot() == before  # looked nothing up, inserted nothing
    assert cache.counters.get("prefix_cache_unscoped") == 1
    assert page_keys(b"a", prompt, PAGE) != page_keys(b"b", prompt, PAGE)


def test_disabled_cache_keeps_nothing():
    cache = _cache(enabled=False)
    prompt = list(range(10, 23))
    assert _run(cache, "a", prompt, b"t") == 0
    assert _run(cache, "b", prompt, b"t") == 0
    assert cache.snapshot().pages == 0 and cache.allocator.snapshot().pages_free == 16


def test_a_running_borrower_blocks_eviction_and_admission_waits_instead():
    cache = _cache(pages=4)
    prompt = list(range(10, 19))  # 3 pages, 2 complete
    _run(cache, "a", prompt, b"t")
    assert cache.reserve("b", prompt, b"t") == 8  # b borrows both cached pages
    assert cache.allocator.snapshot().pages_free == 1
    before = cache.allocator.snapshot()
    assert cache.reserve("c", list(range(40, 52)), b"u") is None  # 3 pages, 1 free, 0 evictable
    assert cache.allocator.snapshot() == before and not cache.allocator.holds("c")
    cache.pool.release("b")
    assert cache.reserve("c", list(range(40, 52)), b"u") == 0  # 2 free: evicts one unread leaf
    assert cache.counters.get("prefix_cache_pages_evicted") == 1
    cache.check_invariants()


def test_eviction_takes_least_recently_used_leaves_and_keeps_the_hit():
    cache = _cache(pages=6)
    old, new = [1] * 4 + [2] * 4 + [3], [5] * 4 + [6] * 4 + [7]
    _run(cache, "a", old, b"t")
    _run(cache, "b", new, b"t")
    _run(cache, "c", old, b"t")  # old is now the most recently used
    assert cache.snapshot().pages == 4 and cache.allocator.snapshot().pages_free == 2
    assert cache.reserve("d", old + [9] * 4, b"t") == 8  # needs 2 more pages: free, no eviction
    cache.pool.release("d")
    assert cache.reserve("e", [8] * 16, b"x") == 0  # needs 4: evicts 2 (new's chain) of 4
    assert cache.counters.get("prefix_cache_pages_evicted") == 2
    cache.pool.release("e")
    assert _run(cache, "f", old, b"t") == 8 and _run(cache, "g", new, b"t") == 0


def test_the_cap_bounds_cached_pages():
    cache = _cache(pages=16, max_pages=3)
    _run(cache, "a", list(range(10, 30)), b"t")  # 5 complete pages; 3 kept
    assert cache.snapshot().pages == 3
    _run(cache, "b", list(range(50, 70)), b"t")  # evicts a's (unread) chain for its own
    assert cache.snapshot().pages == 3 and cache.counters.get("prefix_cache_pages_evicted") == 3


def test_eviction_poisons_what_it_frees():
    cache = _cache(pages=3, poison=True)
    cache.pool.k.fill_(7.0)
    cache.pool.v.fill_(7.0)
    _run(cache, "a", list(range(10, 19)), b"t")
    kept = [p for p in range(3) if cache.allocator.is_cached(p)]
    assert len(kept) == 2 and all((cache.pool.k[:, p] == 7.0).all() for p in kept)
    assert cache.reserve("b", list(range(40, 52)), b"u") == 0  # 3 pages: evicts both
    assert all(cache.pool.k[:, p].isnan().all() for p in kept)


@pytest.mark.parametrize("seed", range(4))
def test_random_traffic_keeps_invariants_and_scopes_apart(seed):
    rng = random.Random(seed)
    cache = _cache(pages=24, max_pages=rng.choice([0, 10]))
    prefixes = [[rng.randrange(3, 50) for _ in range(rng.randrange(4, 14))] for _ in range(4)]
    running: dict[str, tuple[list[int], bytes]] = {}
    seen: dict[bytes, set[tuple[int, ...]]] = {}
    for step in range(600):
        if running and rng.random() < 0.45:
            owner = rng.choice(sorted(running))
            tokens, scope = running.pop(owner)
            cache.insert(owner, tokens, scope)
            cache.pool.release(owner)
            if scope:
                seen.setdefault(scope, set()).update(
                    tuple(tokens[: (i + 1) * PAGE]) for i in range(len(tokens) // PAGE))
        else:
            scope = rng.choice([b"", b"a", b"b", b"c"])
            tokens = rng.choice(prefixes) + [rng.randrange(3, 50)
                                             for _ in range(rng.randrange(1, 9))]
            owner = f"r{step}"
            start = cache.reserve(owner, tokens, scope)
            if start is not None:
                running[owner] = (tokens, scope)
                pages = start // PAGE
                # a hit is a prefix this scope inserted before, whole pages, never the last token
                assert start < len(tokens) and start % PAGE == 0
                assert all(tuple(tokens[: (i + 1) * PAGE]) in seen.get(scope, set())
                           for i in range(pages))
        cache.check_invariants()
        cache.allocator.check_invariants()
    for owner in list(running):
        cache.pool.release(owner)
    snap = cache.allocator.snapshot()
    assert snap.pages_available == snap.pages_total and snap.pages_cached == cache.snapshot().pages


def test_an_unread_parent_of_a_read_page_is_not_counted_as_evictable():
    """S computes a prefix while R (same scope, longer prompt) runs; S's pages are cached, then
    R's next page joins as their child and R still reads it: S's unread pages cannot go (they
    are not leaves), so an admission that would need them waits instead of failing."""
    cache = _cache(pages=10)
    short, long = list(range(10, 19)), list(range(10, 19)) + [30, 31, 32, 33]
    assert cache.reserve("r", long, b"t") == 0  # 4 pages
    assert cache.reserve("s", short, b"t") == 0  # 3 pages
    cache.insert("s", short, b"t")
    cache.pool.release("s")
    assert cache.insert("r", long, b"t") == 1  # its third page, a child of s's second
    assert cache.allocator.snapshot().pages_free == 4
    before = cache.allocator.snapshot()
    assert cache.reserve("q", list(range(50, 74)), b"u") is None  # 6 pages: 4 free, 0 evictable
    assert cache.allocator.snapshot() == before and not cache.allocator.holds("q")
    cache.pool.release("r")
    assert cache.reserve("q", list(range(50, 74)), b"u") == 0  # now r's leaf, then s's pages
    cache.check_invariants()
    cache.allocator.check_invariants()
