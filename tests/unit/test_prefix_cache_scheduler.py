"""Random scheduler workloads with prefix caching on (hypothesis), over a fake runner that keeps a simulated
KV: each slot remembers the (position, token) written into it. Every chunk must find its whole context,
shared cached pages included, holding exactly its own tokens, and must write only into pages nobody else
holds; every request ends with the outputs it would have without the cache (a function of its tokens),
through admission on cached prefixes, chunked prefill, preemption and eviction of cached pages. After the
work only cache-held, evictable pages remain and `reset()` leaves nothing. With one page pool or two (partitions:
a request's pages all in one pool, the prefix shared within it).
"""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.kv_cache.allocator import PageAllocator
from engine.kv_cache.block_table import BlockTables, seq_owner
from engine.kv_cache.prefix_cache import PrefixCache, PrefixSharing, prefix_salt
from engine.request import Request, SampledToken
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from tests.unit.leak_checks import assert_scheduler_empty


def next_token(tokens: list[int]) -> int:
    """The fake model: the next token is a function of every token before it (never EOS)."""
    return 10 + hash(tuple(tokens)) % 7


def expected(prompt: list[int], n: int) -> list[int]:
    toks = list(prompt)
    for _ in range(n):
        toks.append(next_token(toks))
    return toks[len(prompt):]


class KVRunner:
    def __init__(self, sched: Scheduler):
        self.sched, self.kv = sched, {}

    def run(self, out) -> dict[str, SampledToken]:
        tables, alloc = self.sched.tables, self.sched.tables.allocator
        for c in out.chunks:
            req, rid = c.request, c.request.request_id
            assert c.start == c.num_cached == req.num_computed
            for pos, slot in enumerate(tables.slots(rid, 0, c.start)):
                assert self.kv[slot] == (pos, req.token_ids[pos]), f"{rid}: context slot {slot} is stale"
            for i, slot in enumerate(tables.slots(rid, c.start, c.num_tokens)):
                assert alloc.refcount(slot // tables.page_size) == 1, f"{rid} writes into shared page"
                self.kv[slot] = (c.start + i, req.token_ids[c.start + i])
        return {c.request.request_id: SampledToken(next_token(c.request.token_ids)) for c in out.chunks if c.sample}


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    page_size=st.integers(1, 4),
    budget=st.integers(2, 12),
    max_seqs=st.integers(1, 4),
    spare_pages=st.integers(0, 8),
    partitions=st.sampled_from([1, 2]),  # 2: two page pools (expert groups attending data-parallel)
    base=st.lists(st.integers(20, 22), min_size=12, max_size=12),
    reqs=st.lists(st.tuples(st.integers(0, 12), st.lists(st.integers(20, 22), max_size=4), st.integers(1, 6),
                            st.integers(0, 6)), min_size=1, max_size=7),
)
def test_random_workloads_share_prefixes_exactly_and_leak_nothing(page_size, budget, max_seqs, spare_pages,
                                                                 partitions, base, reqs):
    reqs = [(base[:k] + tail or [20], m, arrive) for k, tail, m, arrive in reqs]
    need = max(-(-(len(p) + m - 1) // page_size) for p, m, _ in reqs)
    alloc = PageAllocator(partitions * (need + spare_pages), partitions=partitions)  # each pool holds any request
    tables = BlockTables(alloc, page_size)
    cache = PrefixCache(alloc, page_size, prefix_salt("fake", "layout", page_size))
    s = Scheduler(SchedulerConfig(max_seqs, budget, True), tables, (), PrefixSharing(cache, tables, lambda r: True))
    runner = KVRunner(s)
    pending = sorted((arrive, i, p, m) for i, (p, m, arrive) in enumerate(reqs))
    made: list[Request] = []
    for t in range(2000):
        while pending and pending[0][0] <= t:
            _, i, p, m = pending.pop(0)
            made.append(Request(f"r{i}", p, SamplingParams(max_tokens=m), 0, 0.0))
            s.add(made[-1])
        if not pending and not s.has_work:
            break
        out = s.schedule()
        if not out.empty:
            s.update(out, runner.run(out), float(t))
        held = set().union(*(alloc.pages_of(seq_owner(r.request_id)) for r in s.running)) if s.running else set()
        assert alloc.num_in_use == len(held) and not any(alloc.is_evictable(p) for p in held)
    else:
        raise AssertionError("workload did not finish")
    for x in made:
        assert x.finished and x.output_token_ids == expected(x.prompt_token_ids, x.params.max_tokens)
    assert alloc.num_in_use == 0 and len(cache) == alloc.num_evictable
    s.prefix.reset()
    assert_scheduler_empty(s)
