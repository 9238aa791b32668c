"""PageAllocator with partitions (one page pool per data-parallel attention rank of an expert-parallel replica):
an owner's pages stay in one partition, a new owner goes where most pages are free, eviction and free counts
are per partition, the scheduler preempts only requests whose pages share the short pool, and a cached prefix
never spans two pools. Ends leak-free."""
from __future__ import annotations

import pytest

from engine.errors import OutOfPagesError
from engine.kv_cache.allocator import PageAllocator
from engine.kv_cache.block_table import BlockTables, seq_owner
from engine.kv_cache.prefix_cache import PrefixCache, page_hashes, prefix_salt
from engine.request import Request
from engine.sampler import SampledToken
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from tests.unit.leak_checks import assert_allocator_empty, assert_scheduler_empty


def test_new_owners_go_where_most_pages_are_free_and_stay_there():
    a = PageAllocator(8, partitions=2)  # pages 0-3 | 4-7
    assert a.partition_pages == 4 and [a.partition_of(p) for p in (0, 3, 4, 7)] == [0, 0, 1, 1]
    x = a.allocate("x", 1)  # a tie: the lowest partition
    y = a.allocate("y", 1)  # partition 1 has more free now
    assert x == [0] and y == [4]
    assert a.allocate("x", 2) == [1, 2]  # x grows in its own partition
    assert a.num_free_in(0) == 1 and a.num_free_in(1) == 3 and a.num_free == 4
    assert a.num_free_for("x") == 1 and a.num_free_for("y") == 3 and a.num_free_for("new") == 3
    with pytest.raises(OutOfPagesError, match="partition 0 of 2"):
        a.allocate("x", 2)  # four pages are free, but only one in x's pool
    assert a.pages_of("x") == {0, 1, 2}  # the refused allocation took nothing
    assert a.allocate("z", 3) == [5, 6, 7]  # a new owner: partition 1, the emptier
    for o in ("x", "y", "z"):
        a.release_owner(o)
    assert_allocator_empty(a)


def test_an_owner_cannot_hold_pages_of_two_partitions():
    a = PageAllocator(8, partitions=2)
    a.allocate("x", 1)  # page 0
    b = a.allocate("y", 1)  # page 4
    with pytest.raises(ValueError, match="share one partition"):
        a.share("x", b)
    with pytest.raises(ValueError, match=r"partitions \[0, 1\]"):
        a.share("z", [0] + b)  # refused whole: z holds nothing after
    assert a.pages_of("z") == set()
    res = a.reserve(2, lease_s=10, shared=b)  # a reservation on a shared prefix allocates beside it
    assert res.pages == [4, 5, 6]
    a.cancel(res.reservation_id)
    a.release_owner("x"), a.release_owner("y")
    assert_allocator_empty(a)


def test_eviction_and_free_counts_are_per_partition():
    a, evicted = PageAllocator(8, partitions=2), []
    a.attach_cache("cache", evicted.append)
    p0, p1 = a.allocate("s0", 4), a.allocate("s1", 4)  # every page held
    a.share("cache", p0[:2] + p1[:2])
    a.release_owner("s0"), a.release_owner("s1")  # pages 2, 3, 6, 7 free; 0, 1, 4, 5 cached only
    assert a.num_evictable == 4 and a.num_free_in(0) == a.num_free_in(1) == 4
    # a tie: partition 0; its least recently released cached page (0) went, not partition 1's 4
    assert sorted(a.allocate("t", 3)) == [0, 2, 3] and evicted == [0]
    assert a.num_free_in(0) == 1 and a.num_free_in(1) == 4 and a.is_evictable(1) and a.is_evictable(4)
    a.release_owner("t"), a.release_owner("cache")
    assert_allocator_empty(a)


def test_a_partition_count_that_does_not_divide_the_pages_is_refused():
    with pytest.raises(ValueError, match="3 partitions do not divide 8 pages"):
        PageAllocator(8, partitions=3)


def test_block_tables_fit_within_their_partition():
    t = BlockTables(PageAllocator(8, partitions=2), page_size=4)
    t.append("a", 16)  # four pages: all of partition 0
    assert t.allocator.owner_partition(seq_owner("a")) == 0
    assert not t.fits("a", 1) and t.fits("b", 16)  # a's pool is full; a new sequence fits in partition 1
    t.append("b", 9)
    assert t.get("b").pages == [4, 5, 6]
    t.free("a"), t.free("b")
    assert_allocator_empty(t.allocator)


def test_the_scheduler_preempts_within_the_short_partition():
    """a needs a page while its pool (partition 0) is full and partition 1 has room: the newest request of a's
    own pool (c) is preempted, not the newest overall (d, in partition 1); every request finishes with its
    tokens, leak-free."""
    tables = BlockTables(PageAllocator(8, partitions=2), page_size=2)  # 4 pages a partition
    sched = Scheduler(SchedulerConfig(4, 64, True), tables, (2,))
    shapes = {"a": (3, 4), "b": (5, 1), "c": (3, 4), "d": (1, 4)}  # prompt tokens, max_tokens
    reqs = {r: Request(r, list(range(10, 10 + n)), SamplingParams(max_tokens=m), seed=0, arrival_time=0.0)
            for r, (n, m) in shapes.items()}
    for r in reqs.values():
        sched.add(r)
    preempted, where = [], {}
    for step in range(40):
        if not sched.has_work:
            break
        out = sched.schedule()
        preempted += [(step, rid) for rid in out.preempted]
        for c in out.chunks:
            rid = c.request.request_id
            where.setdefault(rid, []).append(tables.allocator.owner_partition(seq_owner(rid)))
        sampled = {c.request.request_id: SampledToken(100 + c.request.num_output) for c in out.chunks if c.sample}
        sched.update(out, sampled, now=float(step))
    # admitted where most pages were free: a (a tie), b, then c (2 free vs 1), d (the only room)
    assert [where[r][0] for r in "abcd"] == [0, 1, 0, 1]
    assert preempted == [(2, "c")] and set(where["d"]) == {1}  # a's slot 4: c went; d, the newest, stayed
    assert all(r.finished and r.output_token_ids == [100 + i for i in range(shapes[k][1])] for k, r in reqs.items())
    assert_scheduler_empty(sched)


def test_each_pool_caches_its_own_chain():
    """Sequences of two pools can each register part of one chain: a lookup never crosses pools (a request
    never starts on pages of two pools; found by test_prefix_cache_scheduler's random workloads at 2 pools when
    one map served both), and each pool keeps its own copy of a prefix, the longest chain winning."""
    a = PageAllocator(8, partitions=2)
    cache = PrefixCache(a, 2, prefix_salt("m", "layout", 2))
    tokens = [5, 6, 7, 8, 9, 10]
    h = page_hashes(tokens, 2, cache.salt)
    x, y = a.allocate("seq:x", 2), a.allocate("seq:y", 3)  # x in pool 0 (pages 0, 1), y in pool 1 (4, 5, 6)
    assert cache.insert(h[0], x[0]) and cache.insert(h[1], y[1]) and cache.insert(h[2], y[2])
    assert cache.lookup(tokens) == ([x[0]], h[:1])  # not [0, 5, 6]
    assert cache.lookup([1] + tokens[1:]) == ([], [])
    assert cache.insert(h[0], y[0]) and not cache.insert(h[0], x[1])  # pool 1's own copy; pool 0 has one
    assert cache.lookup(tokens) == (y, h) and cache.hashes() == h[:1] + h[1:]  # pool 1's chain is longer
    a.release_owner("seq:x"), a.release_owner("seq:y")
    cache.reset()
    assert_allocator_empty(a)


def test_a_cached_prefix_is_taken_only_while_its_pool_is_not_far_fuller():
    """A request starts on its cached prefix (pool 0) while pool 0 has at least half the free pages of the
    emptiest pool; past that it starts afresh in the emptiest, so a popular prefix does not load one rank only."""
    a = PageAllocator(16, partitions=2)  # pools of 8 pages: 0-7 | 8-15
    cache = PrefixCache(a, 2, prefix_salt("m", "layout", 2))
    prompt = [5, 6, 7, 8, 9]
    warm = a.allocate("seq:w", 2)
    for h, page in zip(page_hashes(prompt, 2, cache.salt), warm):
        cache.insert(h, page)
    assert cache.lookup_to_admit(prompt, 2)[0] == warm  # 6 free in pool 0 vs 8: taken
    a.allocate("seq:w", 4)  # w grows in pool 0 (pages 2-5)
    a.release("seq:w", warm)  # the prefix pages: cached only (free, evictable)
    assert a.num_free_in(0) == 4 and a.num_free_in(1) == 8
    assert cache.lookup_to_admit(prompt, 2)[0] == warm  # 4 >= 8 / 2: still taken
    a.allocate("seq:w", 1)  # pool 0: 3 free
    assert cache.lookup_to_admit(prompt, 2) == ([], [])  # 3 < 8 / 2: start afresh in pool 1
    assert cache.lookup(prompt, 2)[0] == warm  # (the cache still holds it)
    other = a.allocate("seq:v", 2)  # ... where that request's pages get cached too
    for h, page in zip(page_hashes(prompt, 2, cache.salt), other):
        cache.insert(h, page)
    assert other[0] >= 8 and cache.lookup_to_admit(prompt, 2)[0] == other  # the next one shares pool 1's copy
    a.release_owner("seq:w"), a.release_owner("seq:v")
    cache.reset()
    assert_allocator_empty(a)
