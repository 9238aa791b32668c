"""`LLM(pipeline_parallel_size=N)`: layer stages in processes of their own (gloo send/recv of hidden
states on loopback, micro-batches in flight), greedy-equal to one process.

A random-weight Llama with 5 layers at PP=2 (3 + 2 layers) and PP=3 (2 + 2 + 1), several prompts in one
continuous batch with chunked prefill, float32, `assert_greedy_equal` against PP=1 and logits within
1e-4; SmolLM2 (30 layers) at PP=2 (`slow`). Degrees that cannot split the layers, and TP x PP, fail at
construction with typed errors. Every test ends with no pages in use and every stage process reaped.
"""
from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.llm import LLM
from engine.parallel.errors import ParallelConfigError, UnsupportedWithParallelError
from tests.parallel_helpers import PROMPTS, assert_parallel_equal
from tests.tiny_models import write_tiny

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny5(tmp_path_factory):
    return write_tiny("llama", tmp_path_factory.mktemp("pp") / "l5", num_hidden_layers=5, num_attention_heads=8,
                      num_key_value_heads=4, initializer_range=0.1)


@pytest.mark.parametrize("stages", [2, 3])
def test_pp_equals_pp1(tiny5, stages):
    assert_parallel_equal(tiny5, PROMPTS, GREEDY, pipeline_parallel_size=stages)


def test_pp2_tied_embeddings_qwen2(tmp_path_factory):
    d = write_tiny("qwen2", tmp_path_factory.mktemp("pp") / "q", num_hidden_layers=3)  # tied head, qkv bias
    assert_parallel_equal(d, PROMPTS[:2], GREEDY, pipeline_parallel_size=2)


@pytest.mark.parametrize("kw, err, field", [
    (dict(pipeline_parallel_size=6), ParallelConfigError, "pipeline_parallel_size"),
    (dict(pipeline_parallel_size=2, tensor_parallel_size=2), UnsupportedWithParallelError, "pipeline_parallel_size"),
])
def test_bad_degrees_raise_before_starting_stages(tiny5, kw, err, field):
    with pytest.raises(err) as e:
        LLM(model=str(tiny5), dtype="float32", **kw)
    assert e.value.field == field


@pytest.mark.slow
def test_smollm2_pp2_equals_pp1(smollm2_dir):
    from engine.tokenizer import Tokenizer

    tok = Tokenizer(smollm2_dir)
    prompts = [tok.encode(p) for p in ("The capital of France is", "def fibonacci(n):",
                                       "Once upon a time, in a small village by the sea, there lived")]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    assert_parallel_equal(smollm2_dir, prompts, params, pipeline_parallel_size=2, max_num_batched_tokens=8,
                          page_size=8, num_pages=32)
