"""Small pinned cases of the KV quality gates (the full figures come from bench/kv/kv_quality.py): SmolLM2 in
bfloat16 (what serving uses) prefills 1,024 tokens of held-out text into pages of each format, then
scores the next 256 through those pages in chunks of 128.
int8 / fp8: the mean KL divergence per scored token from raw pages' next-token distribution, int8 < 0.005
nats, fp8 < 0.025 (measured 0.0019 / 0.010; fp8 would fail int8's bound), and perplexity within 3% of
raw's (a broken codec's is far off; fp8's own single-window change here is +1.9%, over six windows +0.3%).
Why KL and not the issue's perplexity gate (int8 < 0.2%) on this one window: here a change of the
weights' GEMM blocking alone (raw pages both times) moves raw's perplexity by +0.55% at the same KL per
token as int8 pages (0.0019 nats); the 0.2% gate is judged by the harness on the mean of six 2,048 + 512
windows.
kivi4 (4-bit, its full-precision tail the page a query sits in: < 16 tokens): KL < 0.02 nats at the issue's
2,048 + 512 (its 1% perplexity gate is judged by the harness on six windows, like int8's). Bytes per
token vs raw bfloat16: <= 0.53x (kivi4 <= 0.35x)."""
from __future__ import annotations

import pytest

from engine.kv_cache.quality import corpus_ids, perplexity_of, scored_logprobs
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


def test_kivi4_keeps_the_next_token_distribution_at_the_gate_size():
    """kivi4 at the issue's own size (2,048 prefill + 512 scored in chunks of 128; ~10 s a run), judged as
    int8 and fp8 are: the KL per scored token from raw pages (measured 0.0093 nats; int8 0.0021) and a 3%
    sanity bound on this window's perplexity. Its 1% perplexity gate is the harness's, on the mean of six
    windows (`bench/kv/kv_quality.py --configs raw,kivi4 --only ppl`: +0.22% +- 0.30% on the AMD machine of
    stop 20): this first window alone read +0.37% on one machine and +1.43% on another (+1.59% against
    raw read through SDPA instead of the native prefill kernel), with raw's own perplexity moving 0.2%
    between those two attention paths."""
    kw = dict(dtype="bfloat16", num_pages=200, max_model_len=2624, max_num_batched_tokens=2048)
    raw = LLM("smollm2-135m", **kw)
    ids = corpus_ids(raw.tokenizer, 2560)
    base = scored_logprobs(raw, ids, 2048, 128)
    llm = LLM("smollm2-135m", kv_storage="kivi4", **kw)
    logp = scored_logprobs(llm, ids, 2048, 128)
    kl = (base.exp() * (base - logp)).sum(-1)  # KL(raw || kivi4) per scored position
    assert kl.mean().item() < 0.02, kl.mean().item()
    ppl, base_ppl = perplexity_of(logp, ids, 2048), perplexity_of(base, ids, 2048)
    assert abs(ppl / base_ppl - 1) < 0.03, (ppl, base_ppl)
    assert llm.kv_spec.bytes_per_token_layer() <= 0.35 * raw.kv_spec.bytes_per_token_layer()
    assert_engine_empty(llm)
    assert llm.backend.num_staged == 0  # no full-precision staging row left


def test_h2o_bounds_decode_memory_and_keeps_the_passkey_at_a_generous_budget():
    """H2O's own quality check (its scores move with every step, so it is not compared token for token):
    at 90% of a 1,024-token prompt it still answers the passkey at every depth, while no sequence holds
    more than keep + slack slots after any step."""
    import random

    from engine.kv_cache.quality import passkey_prompt
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
