"""Shared (cached) pages in the allocator and the pool: lent read-only, reference-counted, never
freed while read, never written; poisoning touches only pages that reach the free list; random
workloads keep every invariant."""

from __future__ import annotations

import random

import pytest
import torch

from common.kvpool.allocator import PageAllocator, PageOwnershipError, PoolExhausted
from common.kvpool.kv_cache import KvPool, PoolConfig


def _cached(alloc: PageAllocator, owner: str, tokens: int, give: int) -> list[int]:
    """owner writes `tokens` tokens, then gives its first `give` pages to the cache."""
    pages = alloc.allocate(owner, tokens)
    alloc.mark_written(owner, tokens)
    alloc.give_to_cache(owner, pages[:give])
    return pages[:give]


def test_a_borrowing_table_starts_with_the_cached_pages_and_reads_them():
    alloc = PageAllocator(num_pages=8, page_size=4)
    shared = _cached(alloc, "a", 8, 2)
    alloc.free("a")
    assert alloc.snapshot().pages_free == 6 and alloc.snapshot().pages_cached == 2
    table = alloc.allocate("b", 11, borrowed=shared)
    assert table[:2] == shared and len(table) == 3
    assert alloc.written_tokens("b") == 8  # the borrowed KV is in place
    assert [alloc.refcount(p) for p in shared] == [1, 1]
    alloc.check_read("b", table, 8)
    with pytest.raises(PageOwnershipError, match="only 8 written"):
        alloc.check_read("b", table, 9)
    alloc.check_invariants()


def test_nobody_writes_a_borrowed_page():
    alloc = PageAllocator(num_pages=8, page_size=4)
    shared = _cached(alloc, "a", 8, 2)
    table = alloc.allocate("b", 12, borrowed=shared)
    for token in range(8):
        with pytest.raises(PageOwnershipError, match="only borrows"):
            alloc.check_write("b", table, token)
        with pytest.raises(PageOwnershipError, match="only borrows"):
            alloc.check_write("a", alloc.page_table("a"), token)  # not even the one who wrote it
    alloc.check_write("b", table, 8)


def test_free_returns_only_own_pages_and_drops_borrows():
    alloc = PageAllocator(num_pages=8, page_size=4)
    shared = _cached(alloc, "a", 12, 2)  # a keeps its third page
    third = alloc.page_table("a")[2]
    assert alloc.own_pages("a") == [third]
    assert alloc.free("a") == [third]
    alloc.allocate("b", 9, borrowed=shared)
    alloc.allocate("c", 5, borrowed=shared[:1])
    assert [alloc.refcount(p) for p in shared] == [2, 1]
    own_b = alloc.own_pages("b")
    assert alloc.free("b") == own_b and [alloc.refcount(p) for p in shared] == [1, 0]
    assert all(alloc.is_cached(p) for p in shared)
    alloc.check_invariants()


def test_a_read_page_is_never_evicted_and_a_refused_evict_changes_nothing():
    alloc = PageAllocator(num_pages=6, page_size=2)
    shared = _cached(alloc, "a", 4, 2)
    alloc.free("a")
    alloc.allocate("b", 5, borrowed=shared[:1])
    before = alloc.snapshot()
    with pytest.raises(PageOwnershipError, match="requests read"):
        alloc.evict(shared)  # shared[1] is evictable, shared[0] is read by b
    assert alloc.snapshot() == before and all(alloc.is_cached(p) for p in shared)
    alloc.evict(shared[1:])
    assert not alloc.is_cached(shared[1]) and alloc.snapshot().pages_free == before.pages_free + 1
    with pytest.raises(PageOwnershipError, match="not cached"):
        alloc.evict(shared[1:])
    alloc.free("b")
    alloc.evict(shared[:1])
    assert alloc.snapshot().pages_free == 6
    alloc.check_invariants()


def test_only_complete_written_own_pages_go_to_the_cache():
    alloc = PageAllocator(num_pages=8, page_size=4)
    pages = alloc.allocate("a", 10)
    alloc.mark_written("a", 6)  # page 1 is half written, page 2 not at all
    for bad in ([pages[1]], [pages[2]], [pages[0], pages[0]]):
        with pytest.raises(PageOwnershipError):
            alloc.give_to_cache("a", bad)
    other = alloc.allocate("b", 4)
    alloc.mark_written("b", 4)
    with pytest.raises(PageOwnershipError):
        alloc.give_to_cache("a", other)
    assert alloc.snapshot().pages_cached == 0
    alloc.give_to_cache("a", pages[:1])
    with pytest.raises(PageOwnershipError):
        alloc.give_to_cache("a", pages[:1])  # already the cache's
    alloc.check_invariants()


def test_a_refused_allocation_takes_no_reference():
    alloc = PageAllocator(num_pages=4, page_size=2)
    shared = _cached(alloc, "a", 4, 2)
    alloc.free("a")
    with pytest.raises(PoolExhausted):
        alloc.allocate("b", 12, borrowed=shared)  # needs 4 own pages, 2 free
    with pytest.raises(PageOwnershipError, match="cached"):
        alloc.allocate("b", 6, borrowed=[shared[0], next(p for p in range(4) if p not in shared)])
    with pytest.raises(PageOwnershipError):
        alloc.allocate("b", 6, borrowed=[shared[0], shared[0]])
    assert not alloc.holds("b") and [alloc.refcount(p) for p in shared] == [0, 0]
    assert alloc.can_allocate(8, borrowed=2) and not alloc.can_allocate(8)
    alloc.check_invariants()


def test_check_invariants_detects_a_wrong_reference_count():
    alloc = PageAllocator(num_pages=4, page_size=2)
    shared = _cached(alloc, "a", 2, 1)
    alloc.check_invariants()
    alloc._refs[shared[0]] = 0  # corrupted on purpose: a still reads it
    with pytest.raises(AssertionError, match="reference count"):
        alloc.check_invariants()


@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_with_a_cache_keep_invariants(seed):
    """A model of the pool (who holds which page, what is cached, who reads it) against the
    allocator, through random allocate/borrow/give/free/evict steps."""
    rng = random.Random(seed)
    size = rng.choice([1, 2, 4])
    alloc = PageAllocator(num_pages=29, page_size=size)
    tables: dict[str, list[int]] = {}
    cached: set[int] = set()
    for step in range(1500):
        roll = rng.random()
        if tables and roll < 0.3:
            owner = rng.choice(sorted(tables))
            table = tables.pop(owner)
            assert sorted(alloc.free(owner)) == sorted(p for p in table if p not in cached)
        elif cached and roll < 0.45:
            victims = rng.sample(sorted(cached), rng.randrange(1, len(cached) + 1))
            read = {p for t in tables.values() for p in t}
            if read & set(victims):
                with pytest.raises(PageOwnershipError):
                    alloc.evict(victims)
            else:
                alloc.evict(victims)
                cached -= set(victims)
        elif tables and roll < 0.6:
            owner = rng.choice(sorted(tables))
            complete = tables[owner][: alloc.written_tokens(owner) // size]
            give = [p for p in complete if p not in cached]
            give = rng.sample(give, rng.randrange(0, len(give) + 1))
            alloc.give_to_cache(owner, give)
            cached |= set(give)
        else:
            owner = f"r{step}"
            borrowed = rng.sample(sorted(cached), rng.randrange(0, len(cached) + 1)) if (
                cached and rng.random() < 0.6) else []
            tokens = len(borrowed) * size + rng.randrange(0, 4 * size * 3)
            if alloc.can_allocate(tokens, len(borrowed)):
                tables[owner] = alloc.allocate(owner, tokens, borrowed)
                assert tables[owner][: len(borrowed)] == borrowed
                alloc.mark_written(owner, rng.randrange(len(borrowed) * size, tokens + 1))
            else:
                with pytest.raises(PoolExhausted):
                    alloc.allocate(owner, tokens, borrowed)
        alloc.check_invariants()
        snap = alloc.snapshot()
        own = {p for t in tables.values() for p in t if p not in cached}
        assert snap.pages_cached == len(cached)
        assert snap.pages_free == alloc.num_pages - len(own) - len(cached)
        for page in cached:
            assert alloc.refcount(page) == sum(page in t for t in tables.values())
        for owner, table in tables.items():
            for index, page in enumerate(table):
                if page in cached:
                    with pytest.raises(PageOwnershipError):
                        alloc.check_write(owner, table, index * size)
                else:
                    alloc.check_write(owner, table, index * size)
    for owner in list(tables):
        alloc.free(owner)
    alloc.evict(sorted(cached))
    assert alloc.snapshot().pages_free == alloc.num_pages
    alloc.check_invariants()


def _pool(**flags) -> KvPool:
    return KvPool(PoolConfig(pool_tokens=8 * 4, page_size=4, **flags), num_layers=2,
                  num_kv_heads=1, head_dim=2, dtype=torch.float32, device=torch.device("cpu"))


@pytest.mark.parametrize("flag, value", [("poison_freed", "nan"), ("scrub_freed", 0.0)])
def test_release_fills_only_pages_that_reach_the_free_list(flag, value):
    pool = _pool(**{flag: True})
    pool.k.fill_(7.0)
    pool.v.fill_(7.0)
    alloc = pool.allocator
    shared = _cached(alloc, "a", 8, 1)
    a_rest = alloc.own_pages("a")
    pool.release("a")
    alloc.allocate("b", 8, borrowed=shared)
    b_own = alloc.own_pages("b")
    pool.release("b")

    def filled(page: int) -> bool:
        block = pool.k[:, page]
        return bool(block.isnan().all() if value == "nan" else (block == 0).all())

    assert not filled(shared[0]) and (pool.v[:, shared[0]] == 7.0).all()  # still the cache's KV
    assert all(filled(p) for p in a_rest + b_own)
    pool.evict(shared)
    assert filled(shared[0]) and alloc.snapshot().pages_free == alloc.num_pages


def test_a_refused_evict_fills_nothing():
    pool = _pool(poison_freed=True)
    pool.k.fill_(7.0)
    shared = _cached(pool.allocator, "a", 4, 1)
    with pytest.raises(PageOwnershipError):
        pool.evict(shared)  # a still reads it
    assert (pool.k[:, shared[0]] == 7.0).all()
