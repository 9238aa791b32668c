"""Tensor parallelism of the mixture-of-experts models without rank processes (issue 35): every expert split
as a dense MLP (gate/up by rows of its intermediate width, down by columns), the router whole.

A rank's experts put back together give the whole layer's (transformers 5's fused [E, 2I, H] tensor read as
the rank's gate rows then its up rows, and experts named one by one); the safetensors loader and the in-memory
shard agree; the sharded forward with the ranks as threads (an in-process all-reduce, `test_tp_shard`) equals
one process for each MoE implementation (grouped, per-token, dense), with a dense layer 0 (`mlp_only_layers`);
an expert width the degree does not divide is refused naming the field; expert groups of TP ranks (EP=2 x TP=2
as four threads, two group all-reduces and one over all four) equal one process. The ranks as processes:
tests/integration/test_moe_parallel.py."""
from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from engine.kv_cache.spec import KVPageSpec
from engine.loader import load_config, load_weights
from engine.model import LlamaForward
from engine.parallel.errors import ParallelConfigError
from engine.parallel.expert_worker import expert_model
from engine.parallel.rank_worker import load_shard
from engine.parallel.shard import local_config, shard_kv_spec, shard_weights
from engine.parallel.validate import check_supported
from tests.prompts import MIXED
from tests.tiny_moe_models import write_tiny_moe
from tests.tp_threads import ThreadAllReduce, run_forward, tp_forward

# fused [E, ...] experts with a dense layer 0 / experts one by one, sharded files
ARCHS = {"qwen3_moe": dict(original_format=False, mlp_only_layers=[0]), "mixtral": dict(shard="100KB")}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tpmoe")
    return {arch: write_tiny_moe(arch, root / arch, **kw) for arch, kw in ARCHS.items()}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_rank_experts_reassemble_the_whole_layer(models, arch):
    d = models[arch]
    cfg, full = load_config(d), load_weights(d)
    whole = LlamaForward(cfg, full, torch.float32)
    ranks = []
    for r in range(2):
        from_file, in_memory = load_shard(d, cfg, r, 2), shard_weights(full, cfg, r, 2)
        assert from_file.keys() == in_memory.keys()
        assert all(torch.equal(from_file[n], in_memory[n]) for n in from_file)
        ranks.append(LlamaForward(local_config(cfg, r, 2), in_memory, torch.float32))
    inter = cfg.moe.intermediate_size // 2
    for i, lw in enumerate(whole.layers):
        parts = [m.layers[i].moe for m in ranks]
        if lw.moe is None:  # Qwen3-MoE's dense layer 0: split as any dense MLP
            assert all(m.layers[i].moe is None for m in ranks) and i == 0 and arch == "qwen3_moe"
            continue
        assert all(p.gate_up.shape == (8, 2 * inter, cfg.hidden_size) for p in parts)
        gate = torch.cat([p.gate_up[:, :inter] for p in parts], 1)
        up = torch.cat([p.gate_up[:, inter:] for p in parts], 1)
        assert torch.equal(torch.cat([gate, up], 1), lw.moe.gate_up)
        assert torch.equal(torch.cat([p.down for p in parts], 2), lw.moe.down)
        assert all(torch.equal(p.router, lw.moe.router) for p in parts)  # whole: the same routing on every rank


@pytest.mark.parametrize("impl, size", [("grouped", 2), ("per_token", 2), ("dense", 2), ("grouped", 4)],
                         ids=["grouped", "per_token", "dense", "grouped-tp4"])  # TP=4: 2 KV heads replicated
@pytest.mark.parametrize("arch", list(ARCHS))
def test_sharded_moe_forward_equals_one_process(models, arch, impl, size, monkeypatch):
    monkeypatch.setenv("PDSERVE_MOE", impl)
    d = models[arch]
    cfg, full = load_config(d), load_weights(d)
    spec = KVPageSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, "float32")
    ids = list(MIXED)
    reference = run_forward(LlamaForward(cfg, full, torch.float32), spec, ids)
    logits = tp_forward(cfg, full, spec, ids, size)  # every rank the same sums in the same order
    assert (logits - reference).abs().max() < 1e-4
    assert torch.equal(logits.argmax(-1), reference.argmax(-1))


def test_an_expert_width_the_degree_does_not_divide_is_refused(models):
    cfg = load_config(models["qwen3_moe"])  # 4 query / 2 KV heads, experts 32 wide
    check_supported(cfg, 2)
    check_supported(cfg, 4)
    odd = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, intermediate_size=30))
    with pytest.raises(ParallelConfigError, match="expert intermediate size 30") as e:
        check_supported(odd, 4)
    assert e.value.field == "tensor_parallel_size"


@pytest.mark.parametrize("arch", list(ARCHS))
def test_expert_groups_of_tp_ranks_equal_one_process(models, arch):
    """EP=2 x TP=2 as four threads: rank (e, t) holds expert block e split as TP rank t, TP rank t's heads and
    dense slices; attention and dense layers reduce over its group, MoE outputs over all four."""
    d = models[arch]
    cfg = load_config(d)
    spec = KVPageSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, "float32")
    ids = list(MIXED)
    reference = run_forward(LlamaForward(cfg, load_weights(d), torch.float32), spec, ids)
    world, groups, out = ThreadAllReduce(4), [ThreadAllReduce(2), ThreadAllReduce(2)], [None] * 4

    def rank(g: int) -> None:
        e, t = divmod(g, 2)
        model = expert_model(d, cfg, "float32", e, 2, expert_reduce=world.for_rank(g), tp_rank=t, tp=2,
                             all_reduce=groups[e].for_rank(t))
        assert [lw.moe.experts for lw in model.layers if lw.moe] and all(
            lw.moe.experts == range(4 * e, 4 * e + 4) and lw.moe.gate_up.shape[1] == cfg.moe.intermediate_size
            for lw in model.layers if lw.moe)  # 4 experts, each half its width (gate and up halves)
        out[g] = run_forward(model, shard_kv_spec(spec, t, 2), ids)

    threads = [threading.Thread(target=rank, args=(g,)) for g in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a rank thread is stuck in an all-reduce"
    assert all(o is not None and torch.equal(o, out[0]) for o in out)
    assert (out[0] - reference).abs().max() < 1e-4
    assert torch.equal(out[0].argmax(-1), reference.argmax(-1))
