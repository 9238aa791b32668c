"""KV eviction at the end of prefill (engine/kv_cache/eviction.py): which tokens each policy keeps, the kept
cells moved bit-exactly to the front of the slots, positions kept logical (the next token is at the
prompt length while the cache holds fewer slots), pages returned, speculative decoding equal to plain
decoding under the same policy, recompute after preemption, and typed errors for bad policies."""
from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.errors import InvalidRequestError
from engine.kv_cache.eviction import EvictionPolicy, keep_slots
from engine.llm import LLM
from tests.conftest import assert_engine_empty
from tests.exactness import assert_greedy_equal

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [list(range(10, 70)), [7, 8, 9] * 20 + [5], list(range(100, 140))]
SNAP = {"method": "snapkv", "budget": 0.5, "min_prompt": 16, "window": 8, "pool": 3}
STREAM = {"method": "streaming", "budget": 12, "min_prompt": 16, "sinks": 4}
NUM_PAGES = 26  # 104 slots: the evicted prompts fit at once, their growth and the 40-token prompt do not


def make(tiny_dir, policy=None, **kw):
    return LLM(model=str(tiny_dir), dtype="float32", num_pages=kw.pop("num_pages", 96), page_size=4,
               kv_eviction=policy, **kw)


def test_policies_keep_what_they_promise():
    attn = torch.zeros(4, 40)
    attn[:, [3, 17, 25]] = 1.0  # three tokens the window attends to
    snap = EvictionPolicy("snapkv", budget=7, window=4, pool=1)
    keep = keep_slots(snap, 40, [0, 1], {0: attn, 1: attn})
    assert keep[0].tolist() == [3, 17, 25, 36, 37, 38, 39]  # the hits, then the window; ascending
    pooled = keep_slots(EvictionPolicy("snapkv", budget=10, window=4, pool=3), 40, [0], {0: attn})[0].tolist()
    assert {3, 17, 25, 36, 37, 38, 39} <= set(pooled) and len(pooled) == 10 and pooled == sorted(pooled)
    stream = keep_slots(EvictionPolicy("streaming", budget=0.25, sinks=4), 40, [0], {})[0].tolist()
    assert stream == [0, 1, 2, 3] + list(range(34, 40))
    assert not EvictionPolicy("streaming", budget=0.5, min_prompt=64).applies(40)


@pytest.mark.parametrize("bad", [{"method": "nope"}, {"budget": 0}, {"pool": 2}, {"windw": 3}])
def test_bad_policies_are_typed_errors(tiny_dir, bad):
    with pytest.raises(InvalidRequestError):
        make(tiny_dir, bad)


@pytest.mark.parametrize("policy", [SNAP, STREAM])
def test_kept_cells_move_to_the_front_and_positions_stay_logical(tiny_dir, policy):
    llm = make(tiny_dir, policy)
    pol = llm.eviction
    prompt = PROMPTS[0]
    before = {}
    import engine.evictor as evictor_mod
    orig_compact = evictor_mod.compact

    def spy_compact(backend, pages, keep):  # snapshot the cells the policy keeps, before they move
        for layer, ix in keep.items():
            slots = torch.tensor([pages[t // 4] * 4 + t % 4 for t in ix.tolist()])
            before[layer] = (backend.k[layer].view(-1, *backend.k[layer].shape[2:])[slots].clone(), ix.clone())
        orig_compact(backend, pages, keep)
    seen = []
    orig_launch = llm.runner.launch  # (LLM.step starts each step with launch)

    def spy_launch(batch):
        seen.extend((s.position_start, s.num_cached, len(s.token_ids)) for s in batch.seqs)
        return orig_launch(batch)
    evictor_mod.compact, llm.runner.launch = spy_compact, spy_launch
    try:
        rid = llm.add_request(prompt, GREEDY)
        while llm.requests[rid].num_output == 0:
            llm.step()
        kept = pol.keep_count(len(prompt))
        table = llm.tables.get(rid)
        assert table.num_slots == kept and len(table.pages) == -(-kept // 4)
        for layer, (cells, ix) in before.items():
            assert len(ix) == kept
            front = torch.tensor([table.pages[t // 4] * 4 + t % 4 for t in range(kept)])
            assert torch.equal(llm.backend.k[layer].view(-1, *cells.shape[1:])[front], cells)
        llm.step()
        assert seen[-1] == (len(prompt), kept, 1)  # next token: logical position 60, physical slot `kept`
        while llm.has_unfinished():
            llm.step()
    finally:
        evictor_mod.compact = orig_compact
    assert_engine_empty(llm)


@pytest.mark.parametrize("policy", [SNAP, STREAM])
def test_speculative_output_equals_plain_output_under_the_same_policy(tiny_dir, policy):
    plain = make(tiny_dir, policy)
    want = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    assert plain.num_evicted_tokens > 0
    for proposer in ("oracle", "ngram"):
        spec = make(tiny_dir, policy, speculative={"proposer": proposer, "max_draft": 3, "gate": False})
        assert_greedy_equal(want, [o.token_ids for o in spec.generate(PROMPTS, GREEDY)])
        assert_engine_empty(spec)
    full = [o.token_ids for o in make(tiny_dir).generate(PROMPTS, GREEDY)]
    assert want != full  # eviction really changed what the model saw


def test_short_prompts_and_int8_pages_and_preemption(tiny_dir):
    """Prompts under min_prompt are untouched; eviction composes with int8 pages; a request preempted after
    eviction recomputes in full (no second eviction) and still finishes; nothing leaks."""
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    llm = make(tiny_dir, dict(STREAM, min_prompt=50), kv_storage="int8", num_pages=NUM_PAGES, max_num_seqs=8)
    outs = llm.generate(PROMPTS, long)
    assert all(len(o.token_ids) == 40 for o in outs)
    assert llm.num_evicted_tokens == (60 - 12) + (61 - 12)  # the two long prompts, once each
    assert llm.scheduler.stats.num_preemptions > 0
    assert_engine_empty(llm)


def test_a_request_can_turn_eviction_off_or_on(tiny_dir):
    """`kv_eviction` on the request: "off" keeps every token under a pool policy; a dict evicts on an
    engine without one; a bad field is a typed error naming it."""
    on = make(tiny_dir, SNAP)
    off = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, kv_eviction="off")
    full = [o.token_ids for o in make(tiny_dir).generate(PROMPTS, GREEDY)]
    assert [o.token_ids for o in on.generate(PROMPTS, off)] == full and on.num_evicted_tokens == 0
    plain = make(tiny_dir)
    ask = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, kv_eviction=dict(STREAM))
    want = [o.token_ids for o in make(tiny_dir, STREAM).generate(PROMPTS, GREEDY)]
    assert [o.token_ids for o in plain.generate(PROMPTS, ask)] == want and plain.num_evicted_tokens > 0
    for bad, field in (({"budget": -1}, "kv_eviction.budget"), ({"methd": "x"}, "kv_eviction.methd"),
                       ("on", "kv_eviction")):
        with pytest.raises(InvalidRequestError) as info:
            plain.add_request(PROMPTS[0], SamplingParams(max_tokens=4, kv_eviction=bad))
        assert info.value.field == field
    assert_engine_empty(plain)


def test_h2o_keeps_heavy_hitters_and_bounds_memory_during_decode(tiny_dir):
    mass = torch.zeros(30)
    mass[[2, 11, 19]] = torch.tensor([5.0, 9.0, 7.0])
    keep = keep_slots(EvictionPolicy("h2o", budget=7, window=4), 30, [0], {0: mass})[0].tolist()
    assert keep == [2, 11, 19, 26, 27, 28, 29]
    policy = {"method": "h2o", "budget": 16, "min_prompt": 16, "window": 4, "slack": 8}
    llm = make(tiny_dir, policy)
    long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    rids = [llm.add_request(p, long) for p in PROMPTS]
    peak = 0
    while llm.has_unfinished():
        llm.step()
        peak = max([peak] + [llm.tables.get(r).num_slots for r in rids if r in llm.tables])
    assert peak < 16 + 8, peak  # bounded: after every step, fewer than keep + slack slots
    # the prompts were cut to 16 at their end; then each time 8 decode tokens had arrived, 8 slots went
    assert llm.num_evicted_tokens >= sum(len(p) - 16 for p in PROMPTS) + len(PROMPTS) * (60 // 8 - 1) * 8
    assert not llm.evictor._scores
    assert_engine_empty(llm)
