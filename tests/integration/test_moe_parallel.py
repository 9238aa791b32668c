"""Qwen3 and the MoE models under tensor / pipeline parallelism (gloo rank processes on loopback, float32):
Qwen3 at TP=2 (q/k norms per head are whole on every rank, its heads split) and Qwen3-MoE and Mixtral at PP=2
(each stage holds whole layers, experts included) are greedy-equal to one process with logits within 1e-4;
TP of an MoE model is refused before any rank starts."""
from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.llm import LLM
from engine.parallel.errors import UnsupportedWithParallelError
from tests.parallel_helpers import PROMPTS, assert_parallel_equal
from tests.tiny_moe_models import write_tiny_moe

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def test_qwen3_tp2_equals_tp1(tmp_path):
    d = write_tiny_moe("qwen3", tmp_path / "qwen3")
    assert_parallel_equal(d, PROMPTS, GREEDY, tensor_parallel_size=2)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_moe_pp2_equals_pp1(tmp_path, arch):
    d = write_tiny_moe(arch, tmp_path / arch, num_hidden_layers=3, shard="100KB")
    assert_parallel_equal(d, PROMPTS, GREEDY, pipeline_parallel_size=2)


def test_moe_tp_is_refused_before_ranks_start(tmp_path):
    d = write_tiny_moe("mixtral", tmp_path / "mixtral")
    with pytest.raises(UnsupportedWithParallelError) as e:
        LLM(model=str(d), dtype="float32", tensor_parallel_size=2)
    assert e.value.field == "tensor_parallel_size"
