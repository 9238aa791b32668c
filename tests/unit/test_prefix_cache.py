"""Prefix cache, pure: hash chain and salt, LRU eviction that never touches a held page, and a Hypothesis
state machine that drives allocator + block tables + `PrefixSharing` the way the scheduler does, writing a
simulated "KV" (the token each slot holds) so every shared page is checked to hold the tokens it stands
for and no one ever writes into a page someone else holds. Every test ends leak-free after `reset()`.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.errors import OutOfPagesError
from engine.kv_cache.allocator import PageAllocator
from engine.kv_cache.block_table import BlockTables, seq_owner
from engine.kv_cache.prefix_cache import (CACHE_OWNER, PrefixCache, PrefixSharing, chain_hash, page_hashes,
                                          prefix_salt)
from engine.kv_cache.spec import KVPageSpec
from engine.request import Request
from engine.sampling_params import SamplingParams
from tests.unit.leak_checks import assert_allocator_empty

PS = 4
SALT = prefix_salt("model-a", "layout", PS)


def make(num_pages: int = 16):
    alloc = PageAllocator(num_pages)
    cache = PrefixCache(alloc, PS, SALT)
    tables = BlockTables(alloc, PS)
    return alloc, cache, tables, PrefixSharing(cache, tables, lambda req: True)


def request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), 0, 0.0)


def compute(tables: BlockTables, req: Request, n: int) -> None:
    """What a step does to the page pool: `n` more slots, all computed."""
    tables.append(req.request_id, n)
    req.num_computed += n


# ---- hashes ----------------------------------------------------------------------------------------
def test_chain_hash_depends_on_every_token_the_predecessor_and_the_salt():
    toks = list(range(10, 22))
    hs = page_hashes(toks, PS, SALT)
    assert len(hs) == 3 and len(set(hs)) == 3 and all(len(h) == 16 for h in hs)
    assert page_hashes(toks + [1, 2], PS, SALT) == hs  # a partial last page has no hash
    assert page_hashes(toks, PS, SALT, hs[:1]) == hs  # continuing a chain gives the same hashes
    other = list(toks)
    other[1] += 1  # a change in the first page changes every later page's hash
    assert all(a != b for a, b in zip(page_hashes(other, PS, SALT), hs))
    assert chain_hash(SALT, toks[:4]) == hs[0] != chain_hash(prefix_salt("model-b", "layout", PS), toks[:4])


def test_salt_separates_models_formats_and_page_sizes():
    specs = [KVPageSpec(2, 2, 16, PS, "float32", fmt) for fmt in ("raw", "int8", "fp8")]
    salts = {prefix_salt("m", s.signature(), PS) for s in specs}
    salts |= {prefix_salt("m2", specs[0].signature(), PS), prefix_salt("m", specs[0].signature(), 8)}
    assert len(salts) == 5


# ---- cache + allocator -----------------------------------------------------------------------------
def test_finished_pages_stay_cached_count_as_free_and_are_shared_again():
    alloc, cache, tables, share = make(8)
    a = request("a", list(range(10, 20)))  # 10 tokens: 2 full pages + 2 tokens
    compute(tables, a, 10)
    share.register(a)
    assert len(cache) == 2 and alloc.num_in_use == 3
    tables.free("a")
    share.forget("a")
    assert alloc.num_in_use == 0 and alloc.num_free == 8 and alloc.num_evictable == 2  # cached, evictable
    b = request("b", list(range(10, 18)) + [99, 98, 97])
    hit = share.probe(b)
    assert len(hit.pages) == 2 and hit.num_evictable == 2
    b.num_computed = share.admit(b, hit)
    assert b.num_computed == 8 and alloc.num_evictable == 0 and alloc.num_in_use == 2
    compute(tables, b, 3)
    assert tables.get("b").pages[:2] == hit.pages and all(alloc.refcount(p) == 2 for p in hit.pages)
    tables.free("b")
    share.forget("b")
    assert cache.reset() == 2
    assert_allocator_empty(alloc)


def test_whole_prompt_cached_leaves_the_last_page_to_compute():
    alloc, cache, tables, share = make(8)
    a = request("a", list(range(10, 22)))  # exactly 3 pages
    compute(tables, a, 12)
    share.register(a)
    tables.free("a")
    b = request("b", list(range(10, 22)))
    hit = share.probe(b)
    assert len(hit.pages) == 2  # the third page is recomputed so the last token has a logits row
    c = request("c", list(range(10, 23)))
    assert len(share.probe(c).pages) == 3  # one token past the boundary: every full page is shared
    cache.reset()
    assert_allocator_empty(alloc)


def test_eviction_is_lru_tail_first_and_never_frees_a_held_page():
    alloc, cache, tables, share = make(6)
    a, b = request("a", list(range(10, 18))), request("b", list(range(50, 58)))
    for r in (a, b):
        compute(tables, r, 8)
        share.register(r)
    tables.free("a")  # a's two pages: evictable, a's tail first
    assert alloc.num_free == 4 and alloc.num_evictable == 2
    pa = cache.lookup(a.token_ids)[0]
    got = alloc.allocate("x", 3)  # 2 free + 1 evicted: a's tail page goes, its head stays
    assert pa[1] in got and pa[0] not in got and cache.lookup(a.token_ids)[0] == pa[:1]
    assert cache.stats.evicted_pages == 1
    with pytest.raises(OutOfPagesError):
        alloc.allocate("x", 2)  # b's pages are cached but b holds them: not evictable
    assert len(cache.lookup(b.token_ids)[0]) == 2
    alloc.release_owner("x")
    tables.free("b")
    cache.reset()
    assert_allocator_empty(alloc)


def test_admission_counts_hit_pages_as_no_longer_free():
    alloc, cache, tables, share = make(4)
    a = request("a", list(range(10, 18)))
    compute(tables, a, 8)
    share.register(a)
    tables.free("a")
    assert alloc.num_free == 4  # 2 free + a's 2 cached pages
    b = request("b", list(range(10, 18)) + list(range(30, 39)))  # shares 2 pages, needs 3 more: 5 > 4
    hit = share.probe(b)
    assert len(hit.pages) == 2 and share.pages_short(b, 9, hit)
    assert not share.pages_short(b, 8, hit)  # 2 more pages: fits beside the shared ones
    cache.reset()
    assert_allocator_empty(alloc)


def test_reservation_on_cached_pages_commits_cancels_and_fails_atomically():
    alloc, cache, tables, share = make(6)
    a = request("a", list(range(10, 18)))
    compute(tables, a, 8)
    share.register(a)
    tables.free("a")
    hit = cache.lookup(list(range(10, 20)))[0]
    with pytest.raises(OutOfPagesError):
        alloc.reserve(5, 30.0, hit)  # 2 shared + 5 new > 6: nothing held afterwards
    assert alloc.num_reservations == 0 and all(alloc.is_evictable(p) for p in hit)
    res = alloc.reserve(1, 30.0, hit)
    assert res.num_shared == 2 and res.pages[:2] == hit and alloc.num_in_use == 3
    assert alloc.commit(res.reservation_id, seq_owner("b")) == res.pages
    assert all(alloc.refcount(p) == 2 for p in hit)  # the sequence and the cache
    alloc.release_owner(seq_owner("b"))
    res = alloc.reserve(0, 30.0, hit)
    alloc.cancel(res.reservation_id)
    assert alloc.num_in_use == 0 and alloc.num_evictable == 2
    cache.reset()
    assert_allocator_empty(alloc)


def test_duplicate_pages_keep_the_first_copy_and_rollback_off_a_shared_page():
    alloc, cache, tables, share = make(12)
    a, b = request("a", list(range(10, 19))), request("b", list(range(10, 19)))
    for r in (a, b):  # both computed before either registered (admitted in the same step)
        share.admit(r, share.probe(r))
        compute(tables, r, 9)
    share.register(a)
    share.register(b)
    assert len(cache) == 2 and cache.lookup(a.token_ids)[0] == tables.get("a").pages[:2]
    # b's second page is its own; a's is shared with the cache: a rollback into it keeps only page 0
    assert share.rollback(b, 6) == 6
    assert share.rollback(a, 6) == 4
    for rid in "ab":
        tables.free(rid)
    cache.reset()
    assert_allocator_empty(alloc)


# ---- the state machine -----------------------------------------------------------------------------
NUM_PAGES = 12
ALPHABET = st.integers(3, 5)  # few token ids: prefixes collide often


class PrefixMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.alloc, self.cache, self.tables, self.share = make(NUM_PAGES)
        self.reqs: dict[str, Request] = {}
        self.kv: dict[int, int] = {}  # slot -> token written there (the simulated KV)
        self.other: list[int] = []
        self.n = 0

    def _write(self, req: Request, start: int, n: int) -> None:
        """The forward pass writes slots [start, start + n) of `req`: never into a page someone shares."""
        for s in self.tables.slots(req.request_id, start, n):
            assert self.alloc.refcount(s // PS) == 1, f"write into shared page {s // PS}"
        for i, s in enumerate(self.tables.slots(req.request_id, start, n)):
            self.kv[s] = req.token_ids[start + i]

    @rule(tokens=st.lists(ALPHABET, min_size=1, max_size=14))
    def admit(self, tokens):
        req = request(f"r{self.n}", tokens)
        self.n += 1
        hit = self.share.probe(req)
        if self.share.pages_short(req, len(tokens) - len(hit.pages) * PS, hit):
            return
        req.num_computed = self.share.admit(req, hit)
        for i, p in enumerate(hit.pages):  # every shared page holds exactly the tokens it stands for
            assert [self.kv[p * PS + o] for o in range(PS)] == tokens[i * PS:(i + 1) * PS]
        start = req.num_computed
        self.tables.append(req.request_id, len(tokens) - start)
        self._write(req, start, len(tokens) - start)
        req.num_computed = len(tokens)
        self.reqs[req.request_id] = req

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), k=st.integers(1, 6))
    def grow(self, data, k):
        req = self.reqs[data.draw(st.sampled_from(sorted(self.reqs)))]
        if self.tables.extra_pages_needed(req.request_id, k) > self.alloc.num_free:
            return
        req.token_ids += data.draw(st.lists(ALPHABET, min_size=k, max_size=k))
        start = req.num_computed
        self.tables.append(req.request_id, k)
        self._write(req, start, k)
        req.num_computed += k

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def register(self, data):
        self.share.register(self.reqs[data.draw(st.sampled_from(sorted(self.reqs)))])

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), back=st.integers(1, 8))
    def rollback(self, data, back):
        """Scheduler.truncate: drop computed tokens, recomputing any kept part of a shared page."""
        req = self.reqs[data.draw(st.sampled_from(sorted(self.reqs)))]
        target = max(req.num_prompt, req.num_computed - back)
        keep = self.share.rollback(req, target)
        del req.token_ids[target:]
        self.tables.truncate(req.request_id, keep)
        req.num_computed = keep
        if keep < target and self.tables.extra_pages_needed(req.request_id, target - keep) <= self.alloc.num_free:
            self.tables.append(req.request_id, target - keep)
            self._write(req, keep, target - keep)
            req.num_computed = target

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def finish(self, data):
        req = self.reqs.pop(data.draw(st.sampled_from(sorted(self.reqs))))
        self.share.register(req)
        self.share.forget(req.request_id)
        self.tables.free(req.request_id)

    @rule(n=st.integers(1, 6))
    def pressure(self, n):
        """Someone else (another sequence, a reservation) takes pages: evicts cached ones if it must."""
        if n <= self.alloc.num_free:
            self.other += self.alloc.allocate("other", n)

    @precondition(lambda self: self.other)
    @rule()
    def release_other(self):
        self.alloc.release("other", self.other)
        self.other = []

    @rule()
    def reset(self):
        self.cache.reset()

    @invariant()
    def consistent(self):
        a = self.alloc
        cached = {self.cache.page_of(h) for h in self.cache.hashes()}
        assert cached == a.pages_of(CACHE_OWNER)
        for p in range(NUM_PAGES):
            only_cache = a.refcount(p) == 1 and p in cached
            assert a.is_evictable(p) == only_cache
        assert a.num_free == len(a.free_pages()) + a.num_evictable and a.num_in_use + a.num_free == NUM_PAGES
        assert not set(a.free_pages()) & (cached | set(self.other))
        for rid, req in self.reqs.items():
            pages = self.tables.get(rid).pages
            assert a.pages_of(seq_owner(rid)) == set(pages) and not set(a.free_pages()) & set(pages)
            assert not any(a.is_evictable(p) for p in pages)

    def teardown(self):
        for rid in list(self.reqs):
            self.tables.free(rid)
        if self.other:
            self.alloc.release("other", self.other)
        self.cache.reset()
        assert_allocator_empty(self.alloc)


TestPrefixMachine = PrefixMachine.TestCase
TestPrefixMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])


def test_a_workers_cache_report_is_what_the_router_index_matches():
    """The seam for prefix-aware routing: a worker reports `PrefixCache.hashes()`; the router's index,
    given the pool's salt, names a prompt's pages the same way and matches the tokens the cache holds."""
    from cluster.serving.prefix_routing import PrefixIndex

    alloc, cache, tables, share = make(16)
    a = request("a", list(range(3, 40)))
    compute(tables, a, len(a.token_ids))
    share.register(a)
    index = PrefixIndex(page_size=PS, salt=SALT)
    index.replace("w0", cache.hashes())
    for toks in (a.token_ids, a.token_ids[:13], list(range(3, 11)) + [99] * 8, [99] * 8):
        assert index.matched_tokens("w0", index.hashes(toks)) == cache.cached_prefix_tokens(toks)
    tables.free("a")
    cache.reset()
    assert_allocator_empty(alloc)


def test_scheduler_shares_at_admission_and_rolls_back_off_a_shared_page():
    from engine.request import SampledToken
    from engine.scheduler import Scheduler, SchedulerConfig

    alloc, cache, tables, share = make(16)
    s = Scheduler(SchedulerConfig(), tables, (), share)

    def step():
        out = s.schedule()
        s.update(out, {c.request.request_id: SampledToken(50 + c.request.num_output)
                       for c in out.chunks if c.sample}, 0.0)
        return out

    a = request("a", list(range(10, 16)))  # 6 prompt tokens
    s.add(a)
    for _ in range(3):  # prefill, then two decodes: 8 tokens computed, both pages full and final
        step()
    s.schedule()  # (registers first; a's decode chunk is then scheduled but never run)
    assert len(cache) == 2 and cache.lookup(a.token_ids)[0] == tables.get("a").pages[:2]
    page0, page1 = tables.get("a").pages[:2]
    a.num_computed = 8  # as if the last chunk did not happen: roll back into page 1, which the cache shares
    tables.truncate("a", 8)
    s.truncate(a, 7)
    assert a.num_computed == 4 and tables.get("a").pages == [page0] and len(a.token_ids) == 7
    out = s.schedule()  # the kept part of page 1 is recomputed into a page of a's own
    assert (out.chunks[0].start, out.chunks[0].num_tokens) == (4, 3) and page1 not in tables.get("a").pages
    assert alloc.refcount(page1) == 1 and alloc.is_evictable(page1)  # still cached, intact
    s.finish(a, "abort")
    b = request("b", list(range(10, 16)) + [50, 51, 52])  # a's tokens: both cached pages fit
    s.add(b)
    out = s.schedule()
    assert (out.chunks[0].start, out.chunks[0].num_tokens, out.chunks[0].num_cached) == (8, 1, 8)
    assert tables.get("b").pages[:2] == [page0, page1]
    s.finish(b, "abort")
    cache.reset()
    assert_allocator_empty(alloc)
