"""Leak checks every unit test that builds an allocator, scheduler or engine state ends with.

`assert_allocator_empty`: no page in use, no live reservation, and the allocator's own bookkeeping agrees
(free list holds every page once, no owner left). `assert_scheduler_empty` (vLLM's `assert_scheduler_empty`):
no waiting, running or held request, no block table, and then the allocator check.
"""
from __future__ import annotations


def assert_allocator_empty(alloc) -> None:
    assert alloc.num_in_use == 0, f"{alloc.num_in_use} pages still in use"
    assert alloc.num_free == alloc.num_pages
    assert alloc.num_reservations == 0, f"{alloc.num_reservations} reservations still live"
    assert all(alloc.refcount(p) == 0 for p in range(alloc.num_pages))
    # Private bookkeeping, checked (while it exists) because a leak there is invisible to the counters.
    if hasattr(alloc, "free_pages"):
        assert alloc.free_pages() == list(range(alloc.num_pages)), "free list lost or duplicated a page"
    if hasattr(alloc, "_owned"):
        assert not alloc._owned, f"owners left: {sorted(alloc._owned)}"


def assert_tables_empty(tables) -> None:
    assert len(tables) == 0, "block tables left"
    assert_allocator_empty(tables.allocator)


def assert_scheduler_empty(sched) -> None:
    assert not sched.waiting, [r.request_id for r in sched.waiting]
    assert not sched.running, [r.request_id for r in sched.running]
    assert not sched.held, list(sched.held)
    assert_tables_empty(sched.tables)
