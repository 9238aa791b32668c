"""SmolLM2-135M in float32 with prefix caching on: greedy-equal to the cache off, nothing leaked.

Chat-like traffic: a 200-token "system prompt" shared at lengths 0, 15, 16 (a page boundary), 17 (one
past it), 100 and all 200, plus questions after it; requests arrive staggered into one continuous batch
with chunked prefill. A second run squeezes the pool so cached pages are evicted and requests preempted.
The reference (cache off) keeps logits so a near-tie divergence is tolerated as `assert_greedy_equal`
allows. Each run ends with only cache-held pages left, and `reset_prefix_cache()` empties the pool.
"""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.conftest import assert_engine_empty
from tests.exactness import assert_greedy_equal
from tests.prompts import token_prompts
from tests.unit.leak_checks import assert_allocator_empty, assert_scheduler_empty

pytestmark = pytest.mark.slow

PS = 16
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    system, *questions = token_prompts(tok, [200, 30, 41, 23, 57, 35, 12, 48])
    shared = [0, 15, 16, 17, 100, 200, 200, 16]
    out = [system[:n] + q for n, q in zip(shared, questions)]
    out.insert(1, system[:16])  # a whole prompt that ends on a page boundary, cached by then
    return [system + questions[0]] + out  # the first request warms the cache


@pytest.fixture(scope="module")
def reference(prompts):
    llm = LLM(dtype="float32", page_size=PS, num_pages=256, keep_logits=True)
    outs = llm.generate(prompts, PARAMS)
    return [o.token_ids for o in outs], [torch.stack(o.logits) for o in outs]


def run_staggered(llm: LLM, prompts, every: int = 2) -> list[list[int]]:
    pending, ids, final, step = list(prompts), [], {}, 0
    while pending or llm.has_unfinished():
        if pending and step % every == 0:
            ids.append(llm.add_request(pending.pop(0), PARAMS))
        for o in llm.step():
            if o.finished:
                final[o.request_id] = o
        step += 1
    return [final[i].token_ids for i in ids]


def end_clean(llm: LLM) -> None:
    assert_engine_empty(llm)  # only cache-held, evictable pages remain
    u = llm.kv_usage()
    assert u["cached_pages"] == u["evictable_pages"] > 0
    llm.reset_prefix_cache()
    assert_scheduler_empty(llm.scheduler)
    assert_allocator_empty(llm.allocator)


def test_shared_prefixes_in_a_continuous_batch(prompts, reference):
    llm = LLM(dtype="float32", page_size=PS, num_pages=256, max_num_batched_tokens=128,
              enable_prefix_caching=True)
    got = run_staggered(llm, prompts)
    assert_greedy_equal(reference[0], got, reference[1])
    st = llm.prefix_stats()
    print("prefix stats:", st)
    assert st["hit_tokens"] >= 192 + 96 + 16  # at least: two whole system prompts, 100 -> 96, 16/17 -> 16
    assert llm.scheduler.stats.num_chunked_prefills > 0
    end_clean(llm)


def test_page_pressure_evicts_and_preempts(prompts, reference):
    llm = LLM(dtype="float32", page_size=PS, num_pages=40, max_num_batched_tokens=128,
              enable_prefix_caching=True)
    got = run_staggered(llm, prompts, every=1)
    assert_greedy_equal(reference[0], got, reference[1])
    st = llm.prefix_stats()
    print("prefix stats:", st, "preemptions:", llm.scheduler.stats.num_preemptions)
    assert st["evicted_pages"] > 0 and llm.scheduler.stats.num_preemptions > 0
    end_clean(llm)
