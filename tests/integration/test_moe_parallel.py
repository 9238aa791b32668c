"""Qwen3 and the MoE models under tensor / pipeline / expert parallelism (gloo rank processes on loopback,
float32): Qwen3 at TP=2 (q/k norms per head are whole on every rank, its heads split), Qwen3-MoE and Mixtral at
PP=2 (each stage holds whole layers, experts included) and at EP=2 (each rank half of every MoE layer's experts,
the attention and dense layers whole; Qwen3-MoE with a dense layer 0 and fused expert tensors, Mixtral sharded
one by one) are greedy-equal to one process with logits within 1e-4, four ragged prompts
together (chunked prefill beside decodes) and then one alone; every rank process is reaped; in bf16 (the
experts' partial sums added in bf16) EP=2's first-token logits stay within the MoE tests' bf16 tolerance of
float32's. EP=2 attends data-parallel by default (each rank its own sequences and half the pages, tokens sent to
their experts' ranks: the four prompts run on both ranks, the one alone leaves the other rank idle, a request
longer than one rank's pool is refused), and the replicated layout (EP=2 x TP=2) gives the same tokens.
Qwen3-MoE (fused experts, dense layer 0) and Mixtral (experts one by one, sharded files) at TP=2
(heads split, every expert split by its intermediate width, the router whole, MoE partial sums reduced by the
dense MLP's all-reduce) are greedy-equal to one process the same way; Qwen3-MoE at TP=2 in bf16 stays within
the bf16 bound. EP=2 x TP=2 (two expert groups of two TP ranks, each group its own sequences) is greedy-equal too. KV between EP / TP=2 and
one process over gRPC: test_parallel_kv_transfer.py."""
from __future__ import annotations

import pytest

import torch

from engine import SamplingParams
from engine.errors import InvalidRequestError
from engine.llm import LLM
from tests.conftest import assert_engine_empty
from tests.parallel_helpers import BATCHING, PROMPTS, assert_parallel_equal, assert_ranks_gone, generate
from tests.tiny_moe_models import write_tiny_moe

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def test_qwen3_tp2_equals_tp1(tmp_path):
    d = write_tiny_moe("qwen3", tmp_path / "qwen3")
    assert_parallel_equal(d, PROMPTS, GREEDY, tensor_parallel_size=2)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_moe_pp2_equals_pp1(tmp_path, arch):
    d = write_tiny_moe(arch, tmp_path / arch, num_hidden_layers=3, shard="100KB")
    assert_parallel_equal(d, PROMPTS, GREEDY, pipeline_parallel_size=2)


EP_MODELS = {"qwen3_moe": dict(mlp_only_layers=[0], original_format=False), "mixtral": dict(shard="100KB")}


@pytest.mark.parametrize("arch", list(EP_MODELS))
def test_moe_ep2_equals_one_process(tmp_path, arch):
    d = write_tiny_moe(arch, tmp_path / arch, **EP_MODELS[arch])
    assert_parallel_equal(d, PROMPTS, GREEDY, alone=PROMPTS[:1], expert_parallel_size=2)


@pytest.mark.parametrize("degrees", [dict(expert_parallel_size=2), dict(tensor_parallel_size=2)], ids=["ep2", "tp2"])
def test_moe_bf16_close_to_float32(tmp_path, degrees):
    """bf16 ranks (EP: the experts' partial sums all-reduced in bf16; TP: every expert's and the attention's
    partial products) against one float32 process."""
    d = write_tiny_moe("qwen3_moe", tmp_path / "qwen3_moe", **EP_MODELS["qwen3_moe"])
    first = SamplingParams(max_tokens=1, temperature=0.0)
    ref = torch.stack([lg[0] for lg in generate(d, PROMPTS, first)[1]])  # float32, one process
    with LLM(model=str(d), dtype="bfloat16", keep_logits=True, **degrees, **BATCHING) as llm:
        got = torch.stack([o.logits[0] for o in llm.generate(PROMPTS, first)])
        assert_engine_empty(llm)
    assert_ranks_gone(llm)
    assert (got - ref).abs().max() < 0.25  # test_moe_models' bf16 bound against float32
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75


@pytest.mark.parametrize("arch", list(EP_MODELS))
def test_moe_tp2_equals_one_process(tmp_path, arch):
    d = write_tiny_moe(arch, tmp_path / arch, **EP_MODELS[arch])
    assert_parallel_equal(d, PROMPTS, GREEDY, alone=PROMPTS[:1], tensor_parallel_size=2)


def test_moe_ep2_by_tp2_equals_one_process(tmp_path):
    """Two expert groups of two TP ranks (4 processes): the dense layer 0 and attention reduced in each group,
    the MoE outputs over all four."""
    d = write_tiny_moe("qwen3_moe", tmp_path / "qwen3_moe", **EP_MODELS["qwen3_moe"])
    assert_parallel_equal(d, PROMPTS, GREEDY, tensor_parallel_size=2, expert_parallel_size=2)


def test_ep2_attends_data_parallel_by_default_and_replicated_on_request(tmp_path):
    """expert_parallel_size=2 attends data-parallel by default (as the planner prices EP): the replica's 96 pages
    are two pools of 48, one a rank; the four prompts run on both ranks (some step has rows of both), a request
    longer than one rank's pool is refused although the replica's pages would hold it, the prompts again start on
    their cached prefixes (prefix caching, each pool its own) with the same tokens, and the replicated layout
    (`expert_attention="replicated"`: every expert group attends every sequence), here over groups of two TP
    ranks, gives the same tokens."""
    d = write_tiny_moe("mixtral", tmp_path / "mixtral", **EP_MODELS["mixtral"])
    with LLM(model=str(d), dtype="float32", expert_parallel_size=2, enable_prefix_caching=True, **BATCHING) as llm:
        assert llm.expert_attention == "data" and llm.allocator.partitions == 2 and llm.runner.rank_pages == 48
        ranks, execute = [], llm.runner.execute

        def spy(batch):
            ranks.append({llm.runner.group_of(s.pages)[0] for s in batch.seqs})
            return execute(batch)

        llm.runner.execute = spy
        data = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        assert {0, 1} in ranks
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == data
        assert llm.prefix_stats()["hit_tokens"] > 0
        with pytest.raises(InvalidRequestError, match="KV pool of 192 tokens"):
            llm.generate([[5] * 150], SamplingParams(max_tokens=50))
        assert_engine_empty(llm)
    assert_ranks_gone(llm)
    with LLM(model=str(d), dtype="float32", expert_parallel_size=2, tensor_parallel_size=2, expert_attention="replicated",
             **BATCHING) as rep:
        assert rep.expert_attention == "replicated" and rep.allocator.partitions == 1
        assert [o.token_ids for o in rep.generate(PROMPTS, GREEDY)] == data
        assert_engine_empty(rep)
    assert_ranks_gone(rep)
