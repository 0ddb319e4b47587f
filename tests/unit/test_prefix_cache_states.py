"""The prefix cache as a state machine: reserve / insert / evict / release / lookup from several
concurrent requests with small pools and caps, in every order hypothesis finds. After every step:
every cached page has exactly one entry, free + owned + cached == total, the stats (pages free
and evictable, pages cached, the inserted/evicted counters) tell the truth, and once no request
runs, any prompt the pool can hold is served."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes, initialize, invariant,
                                 precondition, rule)

from common.counters import Counters
from common.kvpool.kv_cache import KvPool, PoolConfig
from prefill_svc.prefix_cache import PrefixCache, PrefixCacheConfig

PAGE = 4
# Prompts that share prefixes at page boundaries and inside pages: the interleavings that matter
# are two requests of one scope with a common prefix that both missed.
STEMS = [[5] * 4 + [6] * 4 + [7] * 4, [5] * 4 + [6] * 4 + [8] * 4, [5] * 4 + [6] * 4, [5] * 6,
         [9] * 4 + [10] * 2]


def _cache(num_pages: int, max_pages: int) -> PrefixCache:
    pool = KvPool(PoolConfig(pool_tokens=num_pages * PAGE, page_size=PAGE), num_layers=1,
                  num_kv_heads=1, head_dim=2, dtype=torch.float32, device=torch.device("cpu"))
    return PrefixCache(pool, PrefixCacheConfig(True, max_pages), Counters())


class PrefixCacheMachine(RuleBasedStateMachine):
    running = Bundle("running")

    def __init__(self) -> None:
        super().__init__()
        self.cache: PrefixCache | None = None
        self.requests: dict[str, tuple[list[int], bytes]] = {}
        self.next_id = 0

    @initialize(num_pages=st.integers(4, 12), max_pages=st.integers(0, 6))
    def make(self, num_pages: int, max_pages: int) -> None:
        self.cache = _cache(num_pages, max_pages)

    @rule(target=running, stem=st.sampled_from(STEMS), tail=st.integers(0, 5),
          scope=st.sampled_from([b"", b"a", b"b"]))
    def reserve(self, stem: list[int], tail: int, scope: bytes):
        tokens = stem + [20 + i for i in range(tail)]
        if not tokens:
            tokens = [3]
        owner = f"r{self.next_id}"
        self.next_id += 1
        before = self.cache.allocator.snapshot()
        start = self.cache.reserve(owner, tokens, scope)
        if start is None:  # refused: nothing changed, and it really did not fit
            assert self.cache.allocator.snapshot() == before
            assert not self.cache.allocator.holds(owner)
            needed = self.cache.allocator.pages_needed(len(tokens))
            assert needed > before.pages_free + self.cache._evictable(set())
            return None
        assert start % PAGE == 0 and start < len(tokens)
        self.requests[owner] = (tokens, scope)
        return owner

    @rule(owner=consumes(running))
    def finish(self, owner: str | None) -> None:
        """The engine's commit: insert the prompt's pages, then release the request."""
        if owner is None:
            return
        tokens, scope = self.requests.pop(owner)
        self.cache.insert(owner, tokens, scope)
        self.cache.pool.release(owner)

    @rule(owner=consumes(running))
    def cancel(self, owner: str | None) -> None:
        """A request that ends before its commit inserts nothing."""
        if owner is None:
            return
        self.requests.pop(owner)
        self.cache.pool.release(owner)

    @precondition(lambda self: self.cache is not None and not self.requests)
    @rule()
    def the_largest_prompt_is_served_once_nothing_runs(self) -> None:
        total = self.cache.allocator.num_pages * PAGE
        assert self.cache.reserve("whole-pool", [4] * total, b"z") == 0
        self.cache.pool.release("whole-pool")

    @invariant()
    def pages_and_stats_tell_the_truth(self) -> None:
        if self.cache is None:
            return
        cache, allocator = self.cache, self.cache.allocator
        cache.check_invariants()  # one entry per cached page, parents present, the cap
        allocator.check_invariants()  # free + owned + cached == total, one owner a page
        snap = allocator.snapshot()
        assert snap.pages_cached == cache.snapshot().pages
        # between steps (insert and release are one engine step) every unread cached page can
        # really be evicted, so what GetStats calls free is what admission can have
        assert snap.pages_evictable == cache._evictable(set())
        counters = cache.counters
        assert (counters.get("prefix_cache_pages_inserted")
                - counters.get("prefix_cache_pages_evicted")) == snap.pages_cached
        owned = sum(len(allocator.own_pages(o)) for o in self.requests)
        assert snap.pages_free + owned + snap.pages_cached == snap.pages_total


PrefixCacheMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestPrefixCacheStates = PrefixCacheMachine.TestCase


def test_an_insert_under_another_requests_chain_keeps_that_chain():
    """The orphaning interleaving: r and s share two pages and both miss; s finishes first and
    fills the cap; r's insert must not evict the chain its new page would hang under (the old
    code evicted it, then raised KeyError after the page had gone to the cache: an orphan that
    counted as free and could never be evicted)."""
    cache = _cache(num_pages=8, max_pages=2)
    short, long = [5] * 4 + [6] * 4 + [1], [5] * 4 + [6] * 4 + [7] * 4 + [2]
    assert cache.reserve("r", long, b"t") == 0
    assert cache.reserve("s", short, b"t") == 0
    assert cache.insert("s", short, b"t") == 2
    cache.pool.release("s")
    assert cache.insert("r", long, b"t") == 0  # the cap is full of r's own chain: nothing added
    cache.pool.release("r")
    cache.check_invariants()
    cache.allocator.check_invariants()
    assert cache.allocator.snapshot().pages_available == 8
    assert cache.reserve("q", [3] * 32, b"u") == 0  # the whole pool: both cached pages evicted
