"""PageAllocator.rename: a reservation's pages pass to another owner without reaching the free
list (decode quarantines pages a late NIXL READ may still land in this way)."""

from __future__ import annotations

import pytest

from common.kvpool.allocator import PageAllocator


def test_rename_moves_the_pages_and_frees_nothing():
    a = PageAllocator(8, 4)
    pages = a.allocate("req", 10)
    a.mark_written("req", 5)
    a.rename("req", "quarantine")
    assert not a.holds("req") and a.page_table("quarantine") == pages
    assert a.written_tokens("quarantine") == 5
    assert all(a.owner_of(p) == "quarantine" for p in pages)
    assert a.snapshot().pages_free == 5
    fresh = a.allocate("req", 10)  # the request gets other pages
    assert not set(fresh) & set(pages)
    a.check_invariants()
    assert a.free("quarantine") == pages and a.snapshot().pages_free == 5


def test_a_rename_that_raises_changes_nothing():
    a = PageAllocator(8, 4)
    a.allocate("req", 4)
    a.allocate("other", 4)
    with pytest.raises(ValueError):
        a.rename("req", "other")
    with pytest.raises(KeyError):
        a.rename("missing", "new")
    assert a.owner_of(a.page_table("req")[0]) == "req"
    assert a.snapshot().pages_free == 6
    a.check_invariants()
