"""Small pinned cases of the KV quality gates (the full figures come from bench/kv_quality.py): SmolLM2 in
bfloat16 (what serving uses) prefills 1,024 tokens of held-out text into pages of each format, then
scores the next 256 through those pages in chunks of 128.
int8 / fp8: the mean KL divergence per scored token from raw pages' next-token distribution, int8 < 0.005
nats, fp8 < 0.025 (measured 0.0019 / 0.010; fp8 would fail int8's bound), and perplexity within 3% of
raw's (a broken codec's is far off; fp8's own single-window change here is +1.9%, over six windows +0.3%).
Why KL and not the issue's perplexity gate (int8 < 0.2%) on this one window: here a change of the
weights' GEMM blocking alone (raw pages both times) moves raw's perplexity by +0.55% at the same KL per
token as int8 pages (0.0019 nats); the 0.2% gate is judged by the harness on the mean of six 2,048 + 512
windows.
kivi4 (4-bit, its full-precision tail the page a query sits in: < 16 tokens) < 1% at the issue's 2,048 +
512. Bytes per token vs raw bfloat16: <= 0.53x (kivi4 <= 0.35x)."""
from __future__ import annotations

import pytest

from bench.kv_quality import corpus_ids, perplexity, perplexity_of, scored_logprobs
from engine import LLM
from tests.conftest import assert_engine_empty

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def raw_scores():
    llm = LLM("smollm2-135m", dtype="bfloat16", num_pages=96, max_num_batched_tokens=1024)
    ids = corpus_ids(llm.tokenizer, 1280)
    logp = scored_logprobs(llm, ids, 1024, 128)
    return ids, logp, perplexity_of(logp, ids, 1024), llm.kv_spec.bytes_per_token_layer()


@pytest.mark.parametrize("fmt, max_kl", [("int8", 0.005), ("fp8", 0.025)])
def test_quantized_pages_keep_the_next_token_distribution(raw_scores, fmt, max_kl):
    ids, base_logp, base_ppl, raw_bytes = raw_scores
    llm = LLM("smollm2-135m", dtype="bfloat16", num_pages=96, max_num_batched_tokens=1024, kv_storage=fmt)
    logp = scored_logprobs(llm, ids, 1024, 128)
    kl = (base_logp.exp() * (base_logp - logp)).sum(-1)  # KL(raw || fmt) per scored position
    assert kl.mean().item() < max_kl, (fmt, kl.mean().item())
    ppl = perplexity_of(logp, ids, 1024)
    assert abs(ppl / base_ppl - 1) < 0.03, (fmt, ppl, base_ppl)  # a sanity bound; one window is noisy
    assert llm.kv_spec.bytes_per_token_layer() <= 0.53 * raw_bytes
    assert_engine_empty(llm)


def test_kivi4_keeps_perplexity_at_the_gate_size():
    """kivi4 at the issue's own size (2,048 prefill + 512 scored in chunks of 128; ~10 s a run): at 256
    scored tokens one window's change wanders by about a percent (1,024 + 256: +1.7%), at 512 it holds
    (four windows of the bench text: +0.37 / +0.57 / -0.11 / +0.72%; this is the first)."""
    kw = dict(dtype="bfloat16", num_pages=200, max_model_len=2624, max_num_batched_tokens=2048)
    raw = LLM("smollm2-135m", **kw)
    ids = corpus_ids(raw.tokenizer, 2560)
    base = perplexity(raw, ids, 2048, 128)
    llm = LLM("smollm2-135m", kv_storage="kivi4", **kw)
    ppl = perplexity(llm, ids, 2048, 128)
    assert abs(ppl / base - 1) < 0.01, (ppl, base)
    assert llm.kv_spec.bytes_per_token_layer() <= 0.35 * raw.kv_spec.bytes_per_token_layer()
    assert_engine_empty(llm)
    assert llm.backend.num_staged == 0  # no full-precision staging row left


def test_h2o_bounds_decode_memory_and_keeps_the_passkey_at_a_generous_budget():
    """H2O's own quality check (its scores move with every step, so it is not compared token for token):
    at 90% of a 1,024-token prompt it still answers the passkey at every depth, while no sequence holds
    more than keep + slack slots after any step."""
    import random

    from bench.kv_quality import passkey_prompt
    from engine import SamplingParams

    policy = {"method": "h2o", "budget": 0.9, "min_prompt": 64, "slack": 16}
    llm = LLM("smollm2-135m", dtype="bfloat16", num_pages=400, max_num_batched_tokens=1024, kv_eviction=policy)
    rng = random.Random(0)
    keys = [rng.randrange(10000, 100000) for _ in range(5)]
    rids = [llm.add_request(passkey_prompt(llm.tokenizer, 1024, d, k), SamplingParams(max_tokens=40, temperature=0))
            for d, k in zip([0.1, 0.3, 0.5, 0.7, 0.9], keys)]
    texts, peak = {}, 0
    while llm.has_unfinished():
        for o in llm.step():
            if o.finished:
                texts[o.request_id] = o.text
        peak = max([peak] + [llm.tables.get(r).num_slots for r in rids if r in llm.tables])
    assert all(str(k) in texts[r] for k, r in zip(keys, rids)), texts
    assert peak < llm.eviction.keep_count(1024) + 16 and llm.num_evicted_tokens > 5 * (1024 - 922)
    assert_engine_empty(llm)
