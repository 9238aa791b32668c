"""SmolLM2-135M in float32 against transformers: greedy tokens and logits at every position.

Eight real-text prompts of 8 to 1,500 tokens, 128 new tokens each with EOS ignored; three of them (under a
page, whole pages, the longest) run one at a time, then all eight together in one continuous batch with
staggered arrivals, longest first, and a page pool small enough that chunked prefill and preemption both
happen. Longest first, the newest request (the one preempted) is a short one, so recompute is cheap; a
pool much smaller, or shortest first, makes the longest prompts evict each other and be recomputed over
and over, which costs minutes and checks nothing more.

The reference is teacher-forced: one transformers forward over each prompt followed by the engine's own 128
tokens gives the logits at every generated position; each engine token must be that position's argmax (a
near-tie tolerated as `tests.exactness` rules) and its logits within 1e-4. By induction this is what
equality with transformers' greedy generate() means, at one forward per prompt instead of 128 decode steps
(generate() took ~85 s of this file's ~175 s); and positions after a tolerated near-tie are still compared.
"""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.conftest import assert_engine_empty
from tests.exactness import assert_greedy_forced, assert_logits_close
from tests.prompts import token_prompts

LENGTHS = [8, 40, 100, 250, 500, 800, 1100, 1500]
ALONE = [0, 5, 7]  # one at a time: 8 tokens (under a page of 16), 800 (50 whole pages), 1,500 (the longest)
NEW_TOKENS = 128
# 4,960 slots for 4,298 prompt tokens + 8 x 128 new ones, arrivals longest first (the scheduler alone, driven
# with these lengths and arrivals): 3 preemptions, of the 8-, 40- and 100-token prompts at 79, 128 and 209 tokens,
# 17 chunked prefills (one a recompute: the 40-token prompt's 128 tokens come back as 43 + 85), 4,714 tokens
# prefilled in 191 steps; 300-312 pages do the same. Shortest first, 322 pages preempted the 1,500-token prompt
# 3 times (8,622 prefilled, 173 steps), 150 pages 95 times (54,210).
BATCH_PAGES = 310
PARAMS = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    """The prompts and a function giving transformers' logits (sdpa, inference_mode, float32) at each of the
    generated positions of prompt + tokens; each (prompt, tokens) is computed once."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = token_prompts(tok, LENGTHS)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32, attn_implementation="sdpa")
    done: dict[tuple[int, ...], torch.Tensor] = {}

    def logits_for(prompt: list[int], tokens: list[int]) -> torch.Tensor:
        """[len(tokens), vocab]: row j scored tokens[j] given prompt + tokens[:j]."""
        key = tuple(prompt + tokens)
        if key not in done:
            with torch.inference_mode():
                hidden = model.model(torch.tensor([key[:-1]])).last_hidden_state[0, len(prompt) - 1:]
                done[key] = model.lm_head(hidden).float()
        return done[key]

    return prompts, logits_for


def _compare(reference, cases, outputs):
    prompts, logits_for = reference
    got = [o.token_ids for o in outputs]
    assert all(len(t) == NEW_TOKENS for t in got), [len(t) for t in got]
    ref_logits = [logits_for(prompts[c], t) for c, t in zip(cases, got)]
    rep = assert_greedy_forced(got, ref_logits)
    worst = max(assert_logits_close(lg, torch.stack(o.logits), NEW_TOKENS, atol=1e-4)
                for lg, o in zip(ref_logits, outputs))
    print(f"{rep}; max |logit difference| {worst:.2e}")


def test_one_at_a_time(reference):
    llm = LLM(dtype="float32", page_size=16, num_pages=128, keep_logits=True)
    outputs = [llm.generate(reference[0][i], PARAMS)[0] for i in ALONE]
    _compare(reference, ALONE, outputs)
    assert_engine_empty(llm)


def test_continuous_batch_with_chunking_and_preemption(reference):
    prompts = reference[0]
    llm = LLM(dtype="float32", page_size=16, num_pages=BATCH_PAGES, max_num_batched_tokens=256, keep_logits=True)
    pending = list(enumerate(prompts))[::-1]  # longest first: the newest, preempted first, are short
    ids: dict[int, str] = {}
    final = {}
    step = 0
    while pending or llm.has_unfinished():
        if pending and step % 3 == 0:  # staggered arrivals: one new request every third step
            i, p = pending.pop(0)
            ids[i] = llm.add_request(p, PARAMS)
        for out in llm.step():
            if out.finished:
                final[out.request_id] = out
        step += 1
    stats = llm.scheduler.stats
    print(stats)  # the counts BATCH_PAGES's comment gives
    assert stats.num_chunked_prefills > 0, "chunked prefill never happened"
    assert stats.num_preemptions > 0, "preemption never happened"
    outputs = [final[ids[i]] for i in range(len(prompts))]
    assert sum(o.num_preemptions for o in outputs) == stats.num_preemptions
    _compare(reference, range(len(prompts)), outputs)
    assert_engine_empty(llm)
