"""`LLM(enable_prefix_caching=True)` on a tiny random Llama (float32): greedy-equal to the cache off.

Prompts share a 30-token prefix at various lengths (none, under a page, exactly a page boundary, one
token past it, the whole prompt cached at a boundary, an identical prompt) and arrive staggered into one
continuous batch; small pools force eviction of cached pages and preemption; speculative decoding with
every draft accepted / rejected (rollback); int8 and fp8 storage; KV-eviction requests stay out of the cache;
prefill-only + add_prefilled. After every step each live request's pages are held by it and neither
free nor evictable; every test ends with only cache-held pages left, then `reset_prefix_cache()` and the
allocator is empty.
"""
from __future__ import annotations

import random

import pytest
import torch

from engine import InvalidRequestError, SamplingParams
from engine.kv_cache.block_table import seq_owner
from engine.kv_cache.prefix_cache import CACHE_OWNER
from engine.llm import LLM
from tests.conftest import assert_engine_empty
from tests.exactness import assert_greedy_equal
from tests.unit.leak_checks import assert_allocator_empty, assert_scheduler_empty

PS = 4
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
rng = random.Random(7)
BASE = [rng.randrange(3, 256) for _ in range(30)]
TAIL = [[rng.randrange(3, 256) for _ in range(n)] for n in (5, 7, 3, 9, 6)]
PROMPTS = [
    BASE,  # warms the cache
    BASE[:8] + TAIL[0],  # shares exactly two pages (a page boundary)
    BASE[:9] + TAIL[1],  # one token past the boundary
    BASE[:16],  # the whole prompt cached, ending at a page boundary
    list(BASE),  # identical prompt: 7 full pages cached, the partial last page computed
    BASE[:3] + TAIL[2],  # under a page: no hit
    TAIL[3] + BASE,  # same tokens at other positions: no hit
    BASE + TAIL[4],  # extends the warm prompt
    BASE[:16] + TAIL[0],
]
# tokens each prompt finds cached when run one at a time in this order (pages of 4, last token computed)
HITS_ONE_AT_A_TIME = [0, 8, 8, 12, 28, 0, 0, 28, 16]


def make(tiny_dir, cache: bool, **kw):
    return LLM(model=str(tiny_dir), dtype="float32", page_size=PS, num_pages=kw.pop("num_pages", 96),
               enable_prefix_caching=cache, **kw)


def check_pages_safe(llm: LLM) -> None:
    """Every page a live request lists is held by it, not free and not evictable; cache maps agree."""
    a, s = llm.allocator, llm.scheduler
    free = set(a.free_pages())
    for req in list(s.running) + list(s.held.values()):
        pages = llm.tables.get(req.request_id).pages
        assert set(pages) <= a.pages_of(seq_owner(req.request_id))
        assert not free & set(pages) and not any(a.is_evictable(p) for p in pages)
    if llm.prefix_cache is not None:
        cached = {llm.prefix_cache.page_of(h) for h in llm.prefix_cache.hashes()}
        assert cached == a.pages_of(CACHE_OWNER) and not cached & free


def run_staggered(llm: LLM, prompts, params=GREEDY, every: int = 2) -> list[list[int]]:
    """One request joins every `every` steps; all run in one continuous batch."""
    pending, ids, final, step = list(prompts), [], {}, 0
    while pending or llm.has_unfinished():
        if pending and step % every == 0:
            ids.append(llm.add_request(pending.pop(0), params))
        for o in llm.step():
            if o.finished:
                final[o.request_id] = o
        check_pages_safe(llm)
        step += 1
    return [final[i].token_ids for i in ids]


def assert_only_cache_left(llm: LLM) -> None:
    """After the work: nothing in use, only (evictable) cache pages; a reset empties the pool."""
    assert_engine_empty(llm)
    u = llm.kv_usage()
    assert u["cached_pages"] == u["evictable_pages"] == llm.allocator.num_pages - len(llm.allocator.free_pages())
    llm.reset_prefix_cache()
    assert llm.kv_usage()["cached_pages"] == 0
    assert_scheduler_empty(llm.scheduler)
    assert_allocator_empty(llm.allocator)


@pytest.fixture(scope="module")
def reference(tiny_dir):
    return [o.token_ids for o in make(tiny_dir, False).generate(PROMPTS, GREEDY)]


def test_one_at_a_time_hits_exactly_the_cached_full_pages(tiny_dir, reference):
    llm = make(tiny_dir, True)
    got = []
    for p, hit in zip(PROMPTS, HITS_ONE_AT_A_TIME):
        before = llm.prefix_stats()["hit_tokens"]
        got.append(llm.generate(p, GREEDY)[0].token_ids)
        assert llm.prefix_stats()["hit_tokens"] - before == hit, p
        assert_engine_empty(llm)  # between requests only cache-held (evictable) pages remain
    assert_greedy_equal(reference, got)
    st = llm.prefix_stats()
    assert st["prefill_tokens_saved"] == sum(HITS_ONE_AT_A_TIME) and 0 < st["hit_rate"] < 1
    assert st["queried_tokens"] == sum(map(len, PROMPTS)) and st["evicted_pages"] == 0
    assert_only_cache_left(llm)


def test_staggered_continuous_batch_is_greedy_equal(tiny_dir, reference):
    llm = make(tiny_dir, True)
    assert_greedy_equal(reference, run_staggered(llm, PROMPTS))
    assert llm.prefix_stats()["hit_tokens"] > 0
    assert_only_cache_left(llm)


def test_chunked_prefill_shares_pages_of_a_prompt_still_being_computed(tiny_dir, reference):
    llm = make(tiny_dir, True, max_num_batched_tokens=8)
    assert_greedy_equal(reference, run_staggered(llm, PROMPTS, every=1))
    assert llm.scheduler.stats.num_chunked_prefills > 0 and llm.prefix_stats()["hit_tokens"] > 0
    assert_only_cache_left(llm)


def test_page_pressure_evicts_only_unheld_pages_and_preempts(tiny_dir, reference):
    llm = make(tiny_dir, True, num_pages=24)  # 96 slots: about two requests at once
    assert_greedy_equal(reference, run_staggered(llm, PROMPTS * 2, every=1)[:len(PROMPTS)])
    st = llm.prefix_stats()
    assert st["evicted_pages"] > 0 and st["hit_tokens"] > 0
    assert llm.scheduler.stats.num_preemptions > 0
    assert_only_cache_left(llm)


def test_preempted_requests_resume_from_their_cached_pages(tiny_dir):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = [BASE + TAIL[i] for i in range(4)]
    ref = [o.token_ids for o in make(tiny_dir, False).generate(prompts, params)]
    llm = make(tiny_dir, True, num_pages=40)
    assert_greedy_equal(ref, [o.token_ids for o in llm.generate(prompts, params)])
    assert llm.scheduler.stats.num_preemptions > 0
    # a preempted request recomputes prompt + outputs: its own registered pages are hits now
    assert llm.prefix_stats()["queries"] > len(prompts)
    assert_only_cache_left(llm)


@pytest.mark.parametrize("proposer", ["oracle", "always_wrong"])
def test_speculative_verify_and_rollback_register_only_accepted_pages(tiny_dir, reference, proposer):
    futures = {tuple(p): r for p, r in zip(PROMPTS, reference)}
    spec = {"proposer": proposer, "gate": False, "adaptive": False, "max_draft": 3,
            "proposer_options": {"futures": futures}}
    llm = make(tiny_dir, True, speculative=spec)
    assert_greedy_equal(reference, run_staggered(llm, PROMPTS))
    assert llm.spec_stats()["num_verifies"] > 0
    assert_only_cache_left(llm)


@pytest.mark.parametrize("storage", ["int8", "fp8"])
def test_quantized_storage_cache_is_greedy_equal_to_the_same_storage_without(tiny_dir, storage):
    ref = [o.token_ids for o in make(tiny_dir, False, kv_storage=storage).generate(PROMPTS, GREEDY)]
    llm = make(tiny_dir, True, kv_storage=storage)
    assert_greedy_equal(ref, run_staggered(llm, PROMPTS))
    assert llm.prefix_stats()["hit_tokens"] > 0
    assert_only_cache_left(llm)


def test_kv_eviction_requests_neither_share_nor_register(tiny_dir):
    stream = {"method": "streaming", "budget": 12, "min_prompt": 16, "sinks": 4}
    ref = [o.token_ids for o in make(tiny_dir, False, kv_eviction=stream).generate(PROMPTS, GREEDY)]
    llm = make(tiny_dir, True, kv_eviction=stream)
    assert_greedy_equal(ref, run_staggered(llm, PROMPTS))
    st = llm.prefix_stats()
    assert st["queries"] == 0 and st["inserted_pages"] == 0 and llm.kv_usage()["cached_pages"] == 0
    off = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, kv_eviction="off")
    for p in PROMPTS[:2]:  # opted out of eviction: cacheable again
        llm.generate(p, off)
    assert llm.prefix_stats()["hit_tokens"] == 8
    assert_only_cache_left(llm)


def test_prefill_only_and_add_prefilled_still_work(tiny_dir, reference):
    llm = make(tiny_dir, True)
    llm.generate(PROMPTS[0], GREEDY)  # warm
    rid = llm.add_request(PROMPTS[1], GREEDY, prefill_only=True)
    first = [o for o in llm.generate_until_idle() if o.request_id == rid][0]
    pages, n = llm.held_pages(rid)
    # held (prefill-only) prompts share cached pages too: the KV sender reads them by slot
    assert n == len(PROMPTS[1]) and llm.prefix_stats()["hit_tokens"] == HITS_ONE_AT_A_TIME[1]
    res = llm.reserve(n)
    for layer in range(llm.config.num_layers):  # copy the held KV into the reservation, as a transfer does
        src = [pages[i // PS] * PS + i % PS for i in range(n)]
        dst = [res.pages[i // PS] * PS + i % PS for i in range(n)]
        llm.backend.write(layer, torch.tensor(dst), *llm.backend.read(layer, torch.tensor(src)))
    llm.release_held(rid)
    did = llm.add_prefilled_request(PROMPTS[1], first.token_ids[0], res.reservation_id, GREEDY)
    out = [o for o in llm.generate_until_idle() if o.request_id == did][-1]
    assert_greedy_equal([reference[1]], [out.token_ids])
    assert_only_cache_left(llm)


def test_reset_while_running_keeps_pages_in_use_and_registers_them_again(tiny_dir, reference):
    llm = make(tiny_dir, True)
    llm.generate(PROMPTS[0], GREEDY)
    ids = [llm.add_request(p, GREEDY) for p in PROMPTS[1:4]]
    outs = {o.request_id: o for o in llm.step()}
    assert llm.reset_prefix_cache() > 0 and llm.kv_usage()["cached_pages"] == 0
    check_pages_safe(llm)
    for o in llm.generate_until_idle():
        outs[o.request_id] = o
    assert_greedy_equal(reference[1:4], [outs[i].token_ids for i in ids])
    assert llm.cached_prefix_tokens(PROMPTS[1]) == 12  # registered again after the reset
    assert_only_cache_left(llm)


def test_reserve_shares_the_cached_prefix_so_only_the_suffix_is_shipped(tiny_dir, reference):
    """The decode-side seam for the disaggregated path: KV for tokens past the cached prefix only."""
    prefill, dec = make(tiny_dir, False), make(tiny_dir, True)
    dec.generate(BASE, GREEDY)  # the decode engine has the system prompt cached
    prompt = PROMPTS[7]  # BASE + TAIL[4]: 7 cached pages (28 tokens), 8 tokens to ship
    rid = prefill.add_request(prompt, GREEDY, prefill_only=True)
    first = [o for o in prefill.generate_until_idle() if o.request_id == rid][0]
    pages, n = prefill.held_pages(rid)
    res = dec.reserve(n, token_ids=prompt)
    start = res.num_shared * PS
    assert start == 28 and len(res.pages) == dec.tables.pages_for(n)
    shared = torch.tensor([res.pages[i // PS] * PS + i % PS for i in range(start)])
    before = [dec.backend.read(layer, shared) for layer in range(dec.config.num_layers)]
    for layer in range(dec.config.num_layers):  # ship only tokens [start, n)
        src = torch.tensor([pages[i // PS] * PS + i % PS for i in range(start, n)])
        dst = torch.tensor([res.pages[i // PS] * PS + i % PS for i in range(start, n)])
        dec.backend.write(layer, dst, *prefill.backend.read(layer, src))
    prefill.release_held(rid)
    with pytest.raises(InvalidRequestError):
        dec.add_prefilled_request(prompt, first.token_ids[0], res.reservation_id, GREEDY, num_slots=20)
    did = dec.add_prefilled_request(prompt, first.token_ids[0], res.reservation_id, GREEDY)
    out = [o for o in dec.generate_until_idle() if o.request_id == did][-1]
    assert_greedy_equal([reference[7]], [out.token_ids])
    st = dec.prefix_stats()
    assert st["shared_received_pages"] == 7 and st["kv_bytes_not_received"] == 7 * dec.kv_spec.bytes_per_page()
    for layer, (k, v) in enumerate(before):  # nothing wrote into the shared pages
        k2, v2 = dec.backend.read(layer, shared)
        assert torch.equal(k, k2) and torch.equal(v, v2)
    cancelled = dec.reserve(n, token_ids=prompt)  # a cancelled reservation hands its shared pages back
    dec.allocator.cancel(cancelled.reservation_id)
    assert_engine_empty(prefill)
    assert_only_cache_left(dec)


def test_off_by_default_changes_nothing(tiny_dir):
    llm = make(tiny_dir, False)
    assert llm.prefix_stats() == {} and "cached_pages" not in llm.kv_usage()
    assert llm.cached_prefix_tokens(BASE) == 0 and llm.reset_prefix_cache() == 0


def test_cached_prefix_tokens_reports_what_a_worker_holds(tiny_dir):
    llm = make(tiny_dir, True)
    llm.generate(BASE, GREEDY)
    assert llm.cached_prefix_tokens(BASE[:9]) == 8 and llm.cached_prefix_tokens(BASE) == 28
    assert llm.cached_prefix_tokens(TAIL[0]) == 0
    assert_only_cache_left(llm)
