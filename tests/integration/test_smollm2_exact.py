"""SmolLM2-135M in float32 against transformers' generate(): greedy tokens and logits at every position.

Eight real-text prompts of 8 to 1,500 tokens, 128 new tokens each with EOS ignored; three of them (under a
page, whole pages, the longest) run one at a time, then all eight together in one continuous batch with
staggered arrivals and a page pool small enough that chunked prefill and preemption both happen (a few
preemptions: a pool much smaller makes the longest prompts evict each other over and over, which costs
minutes and checks nothing more).
"""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.conftest import assert_engine_empty
from tests.exactness import assert_greedy_equal, assert_logits_close
from tests.prompts import token_prompts

LENGTHS = [8, 40, 100, 250, 500, 800, 1100, 1500]
ALONE = [0, 5, 7]  # one at a time: 8 tokens (under a page of 16), 800 (50 whole pages), 1,500 (the longest)
NEW_TOKENS = 128
# 5,152 slots for 4,298 prompt tokens + 8 x 128 new ones: 3 preemptions, 31 chunked prefills, 8,622 tokens
# prefilled (the scheduler alone, driven with these lengths). 150 pages made 95 preemptions and 54,210.
BATCH_PAGES = 322
PARAMS = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    """transformers' greedy tokens and logits for each prompt (sdpa, inference_mode, float32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = token_prompts(tok, LENGTHS)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.generation_config.eos_token_id = None  # EOS ignored, like ignore_eos=True
    tokens, logits = [], []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=tok.pad_token_id or 0)
            tokens.append(out.sequences[0, len(ids):].tolist())
            logits.append(torch.cat(out.logits).float())  # [new_tokens, vocab]
    return prompts, tokens, logits


def _compare(reference, outputs):
    prompts, ref_tokens, ref_logits = reference
    got = [o.token_ids for o in outputs]
    rep = assert_greedy_equal(ref_tokens, got, ref_logits)
    diverged = {c: p for c, p, _ in rep.divergences}
    worst = 0.0
    for case, out in enumerate(outputs):
        upto = diverged.get(case, NEW_TOKENS - 1) + 1  # logits agree up to and including a near-tie
        worst = max(worst, assert_logits_close(ref_logits[case], torch.stack(out.logits), upto, atol=1e-4))
    print(f"max |logit difference| {worst:.2e}")


def test_one_at_a_time(reference):
    llm = LLM(dtype="float32", page_size=16, num_pages=128, keep_logits=True)
    outputs = [llm.generate(reference[0][i], PARAMS)[0] for i in ALONE]
    _compare(tuple([part[i] for i in ALONE] for part in reference), outputs)
    assert_engine_empty(llm)


def test_continuous_batch_with_chunking_and_preemption(reference):
    prompts = reference[0]
    llm = LLM(dtype="float32", page_size=16, num_pages=BATCH_PAGES, max_num_batched_tokens=256, keep_logits=True)
    pending = list(enumerate(prompts))
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
    assert stats.num_chunked_prefills > 0, "chunked prefill never happened"
    assert stats.num_preemptions > 0, "preemption never happened"
    outputs = [final[ids[i]] for i in range(len(prompts))]
    assert sum(o.num_preemptions for o in outputs) == stats.num_preemptions
    _compare(reference, outputs)
    assert_engine_empty(llm)
