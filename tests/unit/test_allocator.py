"""PageAllocator (owners, refcounts, reservations with a fake clock) and BlockTables, ending leak-free."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.errors import OutOfPagesError, ReservationError
from engine.kv_cache.allocator import PageAllocator
from engine.kv_cache.block_table import BlockTables, seq_owner
from tests.unit.leak_checks import assert_allocator_empty, assert_tables_empty


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


# ---- plain pages ---------------------------------------------------------------------------------
def test_allocate_gives_distinct_pages_to_owner():
    a = PageAllocator(8)
    p = a.allocate("x", 3)
    q = a.allocate("x", 2)
    assert len(set(p) | set(q)) == 5 and all(0 <= i < 8 for i in p + q)
    assert a.pages_of("x") == set(p) | set(q)
    assert a.num_in_use == 5 and a.num_free == 3
    assert all(a.refcount(i) == 1 for i in p + q)
    assert a.release_owner("x") == 5
    assert a.pages_of("x") == set()
    assert_allocator_empty(a)


def test_allocate_zero_and_invalid_sizes():
    with pytest.raises(ValueError):
        PageAllocator(0)
    a = PageAllocator(2)
    assert a.allocate("x", 0) == []
    with pytest.raises(ValueError):
        a.allocate("x", -1)
    assert_allocator_empty(a)


def test_out_of_pages_is_atomic():
    a = PageAllocator(4)
    held = a.allocate("x", 3)
    with pytest.raises(OutOfPagesError):
        a.allocate("y", 2)
    assert a.num_free == 1 and a.pages_of("y") == set()  # nothing half-allocated
    assert a.allocate("y", 1)
    a.release("x", held)
    a.release_owner("y")
    assert_allocator_empty(a)


def test_share_and_release_count_references():
    a = PageAllocator(4)
    p = a.allocate("x", 2)
    a.share("y", p)
    a.share("z", p[:1])
    assert [a.refcount(i) for i in p] == [3, 2]
    a.release("x", p)
    assert a.num_in_use == 2  # still held by y (and z)
    a.release("y", p)
    assert a.num_in_use == 1 and a.refcount(p[0]) == 1 and a.refcount(p[1]) == 0
    a.release_owner("z")
    assert_allocator_empty(a)


def test_share_free_page_and_double_release_are_rejected():
    a = PageAllocator(4)
    p = a.allocate("x", 1)
    free_page = next(i for i in range(4) if i not in p)
    with pytest.raises(AssertionError):
        a.share("y", [free_page])
    with pytest.raises(AssertionError):
        a.release("y", p)  # y never held it
    with pytest.raises(AssertionError):
        a.share("x", p)  # x already holds it
    a.release("x", p)
    with pytest.raises(AssertionError):
        a.release("x", p)
    assert_allocator_empty(a)


def test_transfer_moves_references_without_freeing():
    a = PageAllocator(6)
    p = a.allocate("old", 3)
    a.share("other", p[:1])
    moved = a.transfer("old", "new")
    assert sorted(moved) == sorted(p)
    assert a.pages_of("old") == set() and a.pages_of("new") == set(p)
    assert a.num_in_use == 3 and a.refcount(p[0]) == 2
    assert a.transfer("nobody", "new2") == []
    a.release_owner("new")
    a.release_owner("other")
    assert_allocator_empty(a)


# ---- reservations ------------------------------------------------------------------------------
def test_reserve_commit_hands_pages_in_order():
    clock = FakeClock()
    a = PageAllocator(8, clock=clock)
    r = a.reserve(3, lease_s=10)
    assert a.num_reservations == 1 and len(r.pages) == 3
    assert a.pages_of(r.owner) == set(r.pages)
    assert a.get_reservation(r.reservation_id) is r
    pages = a.commit(r.reservation_id, "seq:a")
    assert pages == r.pages  # reservation order, so a block table can adopt them as-is
    assert a.pages_of("seq:a") == set(pages) and a.pages_of(r.owner) == set()
    assert a.num_reservations == 0 and a.finished_reason(r.reservation_id) == "committed"
    with pytest.raises(ReservationError, match="committed"):
        a.get_reservation(r.reservation_id)
    with pytest.raises(ReservationError, match="committed"):
        a.commit(r.reservation_id, "seq:b")
    a.release_owner("seq:a")
    assert_allocator_empty(a)


def test_reservation_ids_and_nonces_are_unique():
    a = PageAllocator(8, clock=FakeClock())
    rs = [a.reserve(1, 5) for _ in range(4)]
    assert len({r.reservation_id for r in rs}) == 4 and len({r.nonce for r in rs}) == 4
    for r in rs:
        a.cancel(r.reservation_id)
    assert_allocator_empty(a)


def test_reservation_expires_on_fake_clock_and_renew_extends():
    clock = FakeClock()
    a = PageAllocator(4, clock=clock)
    r = a.reserve(2, lease_s=10)
    clock.advance(9)
    assert a.expire() == [] and a.num_in_use == 2
    a.renew(r.reservation_id, 10)  # now expires at t0 + 19
    clock.advance(9)  # t0 + 18
    assert a.get_reservation(r.reservation_id) is r
    clock.advance(2)  # t0 + 20
    with pytest.raises(ReservationError, match="expired"):
        a.get_reservation(r.reservation_id)
    assert a.finished_reason(r.reservation_id) == "expired"
    with pytest.raises(ReservationError, match="expired"):
        a.renew(r.reservation_id, 10)
    with pytest.raises(ReservationError, match="expired"):
        a.commit(r.reservation_id, "seq:x")
    assert a.pages_of("seq:x") == set()
    assert_allocator_empty(a)


def test_expire_returns_only_lapsed_ids():
    clock = FakeClock()
    a = PageAllocator(6, clock=clock)
    short = a.reserve(2, 1)
    long = a.reserve(2, 100)
    clock.advance(5)
    assert a.expire() == [short.reservation_id]
    assert a.num_reservations == 1 and a.num_in_use == 2
    assert a.expire() == []
    a.cancel(long.reservation_id)
    assert a.finished_reason(long.reservation_id) == "cancelled"
    assert_allocator_empty(a)


def test_cancel_and_unknown_reservations():
    a = PageAllocator(4, clock=FakeClock())
    r = a.reserve(2, 10)
    a.cancel(r.reservation_id, "aborted by client")
    with pytest.raises(ReservationError, match="aborted by client"):
        a.get_reservation(r.reservation_id)
    a.cancel(r.reservation_id)  # second cancel is a no-op, keeps the first reason
    assert a.finished_reason(r.reservation_id) == "aborted by client"
    with pytest.raises(ReservationError, match="unknown"):
        a.get_reservation("no-such-id")
    a.cancel("no-such-id")  # no-op
    assert a.finished_reason("no-such-id") is None
    assert_allocator_empty(a)


def test_reserve_out_of_pages_leaves_no_reservation():
    a = PageAllocator(3, clock=FakeClock())
    with pytest.raises(OutOfPagesError):
        a.reserve(4, 10)
    assert a.num_reservations == 0
    assert_allocator_empty(a)


def test_finished_reasons_are_bounded():
    a = PageAllocator(2, clock=FakeClock(), remember_finished=3)
    ids = []
    for _ in range(5):
        r = a.reserve(1, 10)
        a.cancel(r.reservation_id)
        ids.append(r.reservation_id)
    assert [a.finished_reason(i) for i in ids] == [None, None, "cancelled", "cancelled", "cancelled"]
    with pytest.raises(ReservationError, match="unknown"):
        a.get_reservation(ids[0])
    assert_allocator_empty(a)


# ---- random operation sequences ----------------------------------------------------------------
NUM_PAGES = 12
OWNERS = ["a", "b", "c", "d"]


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate/share/release/transfer/reserve/commit/cancel/expire against a shadow model."""

    def __init__(self):
        super().__init__()
        self.clock = FakeClock()
        self.alloc = PageAllocator(NUM_PAGES, clock=self.clock)
        self.held: dict[str, set[int]] = {o: set() for o in OWNERS}  # shadow: owner -> pages
        self.res: dict[str, tuple[str, set[int], float]] = {}  # rid -> (owner, pages, expires_at)

    # ---- rules -------------------------------------------------------------------------------
    @rule(owner=st.sampled_from(OWNERS), n=st.integers(0, 5))
    def allocate(self, owner, n):
        if n > self.alloc.num_free:
            with pytest.raises(OutOfPagesError):
                self.alloc.allocate(owner, n)
            return
        pages = self.alloc.allocate(owner, n)
        assert len(set(pages)) == n and not any(p in self.held[owner] for p in pages)
        assert all(not self._owners_of(p) for p in pages), "allocated a page someone holds"
        self.held[owner] |= set(pages)

    @rule(src=st.sampled_from(OWNERS), dst=st.sampled_from(OWNERS), data=st.data())
    def share(self, src, dst, data):
        candidates = sorted(self.held[src] - self.held[dst])
        if src == dst or not candidates:
            return
        pages = data.draw(st.lists(st.sampled_from(candidates), unique=True, max_size=3))
        self.alloc.share(dst, pages)
        self.held[dst] |= set(pages)

    @rule(owner=st.sampled_from(OWNERS), data=st.data())
    def release_some(self, owner, data):
        if not self.held[owner]:
            return
        pages = data.draw(st.lists(st.sampled_from(sorted(self.held[owner])), unique=True, max_size=3))
        self.alloc.release(owner, pages)
        self.held[owner] -= set(pages)

    @rule(owner=st.sampled_from(OWNERS))
    def release_owner(self, owner):
        assert self.alloc.release_owner(owner) == len(self.held[owner])
        self.held[owner] = set()

    @rule(src=st.sampled_from(OWNERS), dst=st.sampled_from(OWNERS))
    def transfer(self, src, dst):
        if src == dst or self.held[src] & self.held[dst]:
            return  # moving a reference onto an owner that already holds the page is an invariant breach
        in_use = self.alloc.num_in_use
        assert sorted(self.alloc.transfer(src, dst)) == sorted(self.held[src])
        assert self.alloc.num_in_use == in_use
        self.held[dst] |= self.held[src]
        self.held[src] = set()

    @rule(n=st.integers(0, 4), lease=st.floats(0.5, 20))
    def reserve(self, n, lease):
        if n > self.alloc.num_free:
            with pytest.raises(OutOfPagesError):
                self.alloc.reserve(n, lease)
            return
        r = self.alloc.reserve(n, lease)
        self.res[r.reservation_id] = (r.owner, set(r.pages), self.clock() + lease)

    @rule(owner=st.sampled_from(OWNERS), data=st.data())
    def commit(self, owner, data):
        if not self.res:
            return
        rid = data.draw(st.sampled_from(list(self.res)))  # insertion order: ids are random
        res_owner, pages, expires = self.res[rid]
        if expires <= self.clock():
            with pytest.raises(ReservationError, match="expired"):
                self.alloc.commit(rid, owner)
            del self.res[rid]
            self._expire_shadow()
            return
        if pages & self.held[owner]:
            return
        got = self.alloc.commit(rid, owner)
        assert set(got) == pages
        self.held[owner] |= pages
        del self.res[rid]
        self._expire_shadow()  # get_reservation() inside commit() expires every lapsed lease
        with pytest.raises(ReservationError, match="committed"):
            self.alloc.get_reservation(rid)

    @rule(data=st.data())
    def cancel(self, data):
        if not self.res:
            return
        rid = data.draw(st.sampled_from(list(self.res)))  # insertion order: ids are random
        self.alloc.cancel(rid)
        del self.res[rid]
        with pytest.raises(ReservationError):
            self.alloc.get_reservation(rid)
        self._expire_shadow()

    @rule(dt=st.floats(0, 10))
    def tick_and_expire(self, dt):
        self.clock.advance(dt)
        lapsed = set(self.alloc.expire())
        assert lapsed == {rid for rid, (_, _, exp) in self.res.items() if exp <= self.clock()}
        self._expire_shadow()

    # ---- shadow helpers ----------------------------------------------------------------------
    def _expire_shadow(self):
        for rid in [rid for rid, (_, _, exp) in self.res.items() if exp <= self.clock()]:
            del self.res[rid]

    def _owners_of(self, page: int) -> list[str]:
        owners = [o for o, ps in self.held.items() if page in ps]
        owners += [ro for ro, ps, _ in self.res.values() if page in ps]
        return owners

    # ---- invariants --------------------------------------------------------------------------
    @invariant()
    def pages_add_up(self):
        assert self.alloc.num_free + self.alloc.num_in_use == NUM_PAGES
        free = self.alloc.free_pages()
        assert len(free) == len(set(free)) == self.alloc.num_free
        for p in range(NUM_PAGES):
            owners = self._owners_of(p)
            assert self.alloc.refcount(p) == len(owners), (p, owners)
            assert (p in free) == (not owners), f"page {p} free={p in free} owners={owners}"
        for o, ps in self.held.items():
            assert self.alloc.pages_of(o) == ps
        assert self.alloc.num_reservations == len(self.res)

    def teardown(self):
        for rid in list(self.res):
            self.alloc.cancel(rid)
        for o in OWNERS:
            self.alloc.release_owner(o)
        assert_allocator_empty(self.alloc)


AllocatorMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_allocator_random_operations = AllocatorMachine.TestCase
