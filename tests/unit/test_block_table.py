"""BlockTables: pages per sequence over a PageAllocator (append, truncate, slots, adopt); ends leak-free."""
from __future__ import annotations

import pytest

from engine.errors import OutOfPagesError
from engine.kv_cache.allocator import PageAllocator
from engine.kv_cache.block_table import BlockTables, seq_owner
from tests.unit.leak_checks import assert_allocator_empty, assert_tables_empty
from tests.unit.test_allocator import FakeClock


# ---- block tables ------------------------------------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 3, 4])
def test_append_allocates_ceil_pages(page_size):
    a = PageAllocator(32)
    t = BlockTables(a, page_size)
    total = 0
    for n in [1, 2, 5, 0, 7, 3]:
        expected_extra = -(-(total + n) // page_size) - -(-total // page_size)
        assert t.extra_pages_needed("s", n) == expected_extra
        before = a.num_in_use
        t.append("s", n)
        total += n
        assert a.num_in_use - before == expected_extra
        assert t.get("s").num_slots == total
        assert len(t.get("s").pages) == -(-total // page_size)
    assert a.pages_of(seq_owner("s")) == set(t.get("s").pages)
    t.free("s")
    t.free("s")  # freeing twice is harmless
    assert_tables_empty(t)


def test_append_out_of_pages():
    a = PageAllocator(2)
    t = BlockTables(a, 4)
    t.append("s", 8)
    with pytest.raises(OutOfPagesError):
        t.append("s", 1)
    assert t.get("s").num_slots == 8
    t.free("s")
    assert_tables_empty(t)


def test_truncate_frees_whole_unused_pages_only():
    a = PageAllocator(8)
    t = BlockTables(a, 4)
    t.append("s", 10)  # 3 pages: 4 + 4 + 2
    pages = list(t.get("s").pages)
    t.truncate("s", 9)  # still needs 3 pages
    assert t.get("s").pages == pages and a.num_in_use == 3
    t.truncate("s", 8)  # exactly 2 pages
    assert t.get("s").pages == pages[:2] and a.num_in_use == 2 and a.refcount(pages[2]) == 0
    t.truncate("s", 5)
    assert t.get("s").pages == pages[:2] and t.get("s").num_slots == 5
    with pytest.raises(AssertionError):
        t.truncate("s", 6)  # cannot grow by truncating
    t.append("s", 4)  # 9 slots: third page comes back
    assert len(t.get("s").pages) == 3 and t.get("s").pages[:2] == pages[:2]
    t.truncate("s", 0)
    assert t.get("s").pages == [] and a.num_in_use == 0
    t.free("s")
    assert_tables_empty(t)


def test_truncate_keeps_shared_pages_alive():
    a = PageAllocator(4)
    t = BlockTables(a, 2)
    t.append("s", 4)
    shared = t.get("s").pages[1]
    a.share("prefix-cache", [shared])
    t.truncate("s", 2)
    assert a.refcount(shared) == 1 and a.num_in_use == 2
    a.release_owner("prefix-cache")
    t.free("s")
    assert_tables_empty(t)


def test_slots_map_to_page_and_offset():
    a = PageAllocator(16)
    t = BlockTables(a, 3)
    a.allocate("pad", 1)  # so page ids do not start at 0
    t.append("a", 2)
    t.append("b", 4)
    t.append("a", 5)  # a's pages interleave with b's
    pa = t.get("a").pages
    assert t.slots("a", 0, 7) == [pa[i // 3] * 3 + i % 3 for i in range(7)]
    assert t.slots("a", 2, 3) == t.slots("a", 0, 7)[2:5]
    all_slots = t.slots("a", 0, 7) + t.slots("b", 0, 4)
    assert len(set(all_slots)) == 11  # no two sequences (or slots) share a physical slot
    assert all(s // 3 in set(pa) for s in t.slots("a", 0, 7))
    assert all(s // 3 in set(t.get("b").pages) for s in t.slots("b", 0, 4))
    t.free("a")
    t.free("b")
    a.release_owner("pad")
    assert_tables_empty(t)


def test_adopt_committed_reservation():
    clock = FakeClock()
    a = PageAllocator(8, clock=clock)
    t = BlockTables(a, 4)
    r = a.reserve(t.pages_for(10), lease_s=5)
    pages = a.commit(r.reservation_id, seq_owner("s"))
    t.adopt("s", pages, 10)
    assert t.get("s").pages == pages and t.get("s").num_slots == 10
    t.append("s", 3)  # 13 slots -> a 4th page
    assert len(t.get("s").pages) == 4 and t.get("s").pages[:3] == pages
    with pytest.raises(AssertionError):
        t.adopt("s", pages, 10)  # already has a table
    with pytest.raises(AssertionError):
        t.adopt("u", pages[:1], 10)  # page count does not cover the slots
    t.free("s")
    assert_tables_empty(t)


def test_peak_pages_counts_drafts_and_outlives_the_table():
    """The most pages held at once: rolled-back drafts count, a freed sequence's peak stays readable, and
    a sequence that comes back (preempted, recomputed) continues from it."""
    a = PageAllocator(16)
    t = BlockTables(a, 4)
    t.append("s", 6)  # 2 pages
    t.append("s", 5)  # drafts: 3 pages
    t.truncate("s", 7)  # rolled back to 2
    assert len(t.get("s").pages) == 2 and t.peak_pages("s") == 3
    t.free("s")
    assert t.peak_pages("s") == 3 and t.peak_pages("never") == 0
    t.append("s", 2)  # recomputed: 1 page, the peak stays
    assert t.peak_pages("s") == 3
    t.append("s", 14)  # 4 pages
    t.free("s")
    assert t.peak_pages("s") == 4
    assert_tables_empty(t)
