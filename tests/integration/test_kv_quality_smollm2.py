"""Small pinned cases of the KV quality gates (the full figures come from bench/kv_quality.py): SmolLM2 in
bfloat16 (what serving uses) prefills 1,024 tokens of held-out text into pages of each format, then
scores the next 256 through those pages in chunks of 128. Perplexity change vs raw pages: int8 < 0.2%,
fp8 < 1%. Bytes per token vs raw bfloat16: <= 0.53x."""
from __future__ import annotations

import pytest

from bench.kv_quality import corpus_ids, perplexity
from engine import LLM
from tests.conftest import assert_engine_empty

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def raw_ppl():
    llm = LLM("smollm2-135m", dtype="bfloat16", num_pages=96, max_num_batched_tokens=1024)
    ids = corpus_ids(llm.tokenizer, 1280)
    return ids, perplexity(llm, ids, 1024, 128), llm.kv_spec.bytes_per_token_layer()


@pytest.mark.parametrize("fmt, gate", [("int8", 0.002), ("fp8", 0.01)])
def test_quantized_pages_keep_perplexity(raw_ppl, fmt, gate):
    ids, base, raw_bytes = raw_ppl
    llm = LLM("smollm2-135m", dtype="bfloat16", num_pages=96, max_num_batched_tokens=1024, kv_storage=fmt)
    ppl = perplexity(llm, ids, 1024, 128)
    assert abs(ppl / base - 1) < gate, (fmt, ppl, base)
    assert llm.kv_spec.bytes_per_token_layer() <= 0.53 * raw_bytes
    assert_engine_empty(llm)
