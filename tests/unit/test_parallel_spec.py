"""Tensor/pipeline parallel pools in the cluster spec (issue 9 item 4), no Ray: the degrees reach the engine,
a replica's resources scale with its ranks, `placement` picks how they are reserved, and the spec judges
degrees and options with the engine's own validators (engine/parallel/validate.py), so both agree.
"""
from __future__ import annotations

import dataclasses

import pytest

from cluster.serving import actors, placement
from cluster.spec import SpecError, parse_spec
from engine.config import ModelConfig
from engine.parallel.errors import ParallelConfigError, UnsupportedWithParallelError
from engine.parallel.validate import check_supported, parallel_problems

SMOLLM2 = ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, max_position=8192,
                      tie_word_embeddings=True, qkv_bias=False)


def spec(prefill: dict | None = None, decode: dict | None = None):
    return parse_spec({"model": "m", "pools": {"prefill": prefill or {}, "decode": decode or {}}})


def test_degrees_reach_the_engine_only_when_parallel():
    s = spec({"tensor_parallel": 3}, {"pipeline_parallel": 2})
    assert s.engine_kwargs("prefill")["tensor_parallel_size"] == 3
    assert s.engine_kwargs("decode")["pipeline_parallel_size"] == 2
    assert "tensor_parallel_size" not in s.engine_kwargs("decode")
    assert "pipeline_parallel_size" not in s.engine_kwargs("prefill")
    s.check_against_model(SMOLLM2)  # TP=3 and PP=2 on SmolLM2: runnable, no SpecError


def test_resources_are_per_rank_and_placement_picks_the_bundles():
    s = spec({"tensor_parallel": 3, "resources": {"num_cpus": 0.5, "custom": {"pre": 1}}},
             {"tensor_parallel": 3, "placement": "strict_pack", "resources": {"num_cpus": 0.5}})
    pre, dec = s.pools.prefill, s.pools.decode
    assert (pre.placement, pre.degree, dec.placement) == ("pack", 3, "strict_pack")
    opts = actors.actor_options(pre, s)  # pack: the actor holds its ranks' bundle
    assert (opts["num_cpus"], opts["num_gpus"], opts["resources"]) == (1.5, 0.0, {"pre": 3.0})
    assert placement.bundle(pre, pre.degree) == {"CPU": 1.5, "pre": 3.0}
    assert actors.actor_options(dec, s)["num_cpus"] == 0.5  # strict_pack: bundle 0 of its group
    assert "strict_pack x3" in dec.describe() and "pack x3" in pre.describe()


def test_strict_pack_with_gpus_is_refused():
    with pytest.raises(SpecError, match="pools.decode.placement: strict_pack with GPUs"):
        spec(None, {"tensor_parallel": 2, "placement": "strict_pack", "resources": {"num_gpus": 1}})
    spec(None, {"placement": "strict_pack", "resources": {"num_gpus": 1}})  # one rank: nothing to split


@pytest.mark.parametrize("name, pool, key, reason", [
    ("decode", {"tensor_parallel": 9}, "tensor_parallel", "intermediate_size 1536"),  # heads split, the MLP not
    ("decode", {"pipeline_parallel": 31}, "pipeline_parallel", "31 stages for the model's 30 layers"),
    ("decode", {"tensor_parallel": 3, "pipeline_parallel": 2}, "pipeline_parallel", "stages of several tensor-"),
    ("decode", {"tensor_parallel": 3, "speculative": {}}, "speculative", "draft-verify"),
    ("prefill", {"pipeline_parallel": 2, "kv": {"eviction": {"budget": 64}}}, "kv.eviction", "eviction observes"),
])
def test_spec_and_engine_refuse_the_same_layouts(name, pool, key, reason):
    s = spec(pool, None) if name == "prefill" else spec(None, pool)
    with pytest.raises(SpecError) as info:
        s.check_against_model(SMOLLM2)
    assert f"pools.{name}.{key}: " in str(info.value) and reason in str(info.value)
    p = s.pools_in_use()[name]
    errs = parallel_problems(SMOLLM2, p.tensor_parallel, p.pipeline_parallel, p.speculative is not None,
                             p.kv.eviction is not None)
    assert errs and all(isinstance(e, (ParallelConfigError, UnsupportedWithParallelError)) for e in errs)
    with pytest.raises(type(errs[0])):
        check_supported(SMOLLM2, p.tensor_parallel, {} if p.speculative else None,
                        {} if p.kv.eviction else None, p.pipeline_parallel)


def test_uneven_stages_run_in_the_engine_so_the_spec_takes_them():
    spec(None, {"pipeline_parallel": 4}).check_against_model(SMOLLM2)  # 30 layers: stages of 8, 8, 7, 7
    odd = dataclasses.replace(SMOLLM2, intermediate_size=1152)
    spec(None, {"tensor_parallel": 9}).check_against_model(odd)  # KV heads replicated 3x
