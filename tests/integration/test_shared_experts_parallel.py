"""Qwen2-MoE's shared expert under parallelism, as rank processes (gloo on loopback, float32): at TP=2 (the
shared expert split as a dense MLP, its sigmoid gate whole on every rank) and at EP=2 (the shared expert whole
on every rank, added once after the experts' all-reduce), four ragged prompts together (chunked prefill beside
decodes) and then one alone give transformers' own greedy tokens, and every rank process is reaped. The tiny
checkpoint: tests/tiny_moe_models.py's Qwen2-MoE with layer 0 dense (`mlp_only_layers`) and fused expert
tensors. Threads-only versions (EP=2 x TP=2 too): tests/unit/test_shared_experts.py."""
from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.exactness import assert_greedy_equal
from tests.parallel_helpers import PROMPTS, generate
from tests.tiny_moe_models import hf_greedy, write_tiny_moe

NEW = 10
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    d = write_tiny_moe("qwen2_moe", tmp_path_factory.mktemp("q2m") / "qwen2_moe", num_hidden_layers=3,
                       mlp_only_layers=[0], original_format=False)
    return d, hf_greedy(d, PROMPTS + PROMPTS[:1], NEW)  # the prompts together, then the first alone


@pytest.mark.parametrize("degrees", [dict(tensor_parallel_size=2), dict(expert_parallel_size=2)],
                         ids=["tp2", "ep2"])
def test_parallel_ranks_equal_transformers_generate(qwen2_moe, degrees):
    d, (tokens, logits) = qwen2_moe
    got, _ = generate(d, PROMPTS, GREEDY, alone=PROMPTS[:1], **degrees)  # closed, empty, ranks reaped
    assert_greedy_equal(tokens, got, logits)
