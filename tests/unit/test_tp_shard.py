"""Tensor-parallel sharding (engine/parallel/shard.py) and the sharded forward, in one process.

Degrees are validated against the heads (typed errors naming the field); head ownership with KV-head
replication; shards put back together give the full weights; a rank's KV page spec; and the forward over
local heads with row-parallel all-reduce equals the single-process forward: the ranks run as threads
here, summing partial products through an in-process all-reduce (no process group, no processes).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config import ModelConfig
from engine.kv_cache.spec import KVPageSpec
from engine.loader import load_config, load_weights
from engine.model import LlamaForward
from engine.parallel.errors import ParallelConfigError
from engine.parallel.shard import (kv_head_range, kv_replicas, local_config, q_head_range, shard_kv_spec,
                                   shard_weights, validate_tp)
from tests.prompts import MIXED
from tests.tiny_models import write_tiny
from tests.tp_threads import run_forward, tp_forward


def cfg_of(heads: int, kv: int, inter: int = 144):
    return ModelConfig(model_type="llama", vocab_size=256, hidden_size=heads * 8, intermediate_size=inter,
                       num_layers=2, num_heads=heads, num_kv_heads=kv, head_dim=8, rms_norm_eps=1e-5,
                       max_position=512, tie_word_embeddings=False, qkv_bias=False)


@pytest.mark.parametrize("heads, kv, size", [(8, 4, 1), (8, 4, 2), (8, 4, 4), (8, 2, 4), (8, 2, 8),
                                             (9, 3, 3), (8, 8, 8), (8, 1, 2)])
def test_valid_degrees(heads, kv, size):
    validate_tp(cfg_of(heads, kv), size)


@pytest.mark.parametrize("heads, kv, size, what", [
    (8, 4, 3, "query heads"),  # 3 does not divide 8 query heads
    (9, 3, 2, "query heads"),  # SmolLM2 at TP=2
    (12, 4, 6, "KV heads"),  # 6 divides 12 query heads, but neither divides nor is a multiple of 4 KV heads
    (8, 4, 0, "positive integer"),
    (8, 4, True, "positive integer"),
])
def test_invalid_degrees_raise_typed_errors_naming_the_field(heads, kv, size, what):
    with pytest.raises(ParallelConfigError, match=what) as e:
        validate_tp(cfg_of(heads, kv), size)
    assert e.value.field == "tensor_parallel_size" and isinstance(e.value, ValueError)


def test_intermediate_size_must_divide():
    with pytest.raises(ParallelConfigError, match="intermediate_size"):
        validate_tp(cfg_of(8, 4, inter=130), 4)


def test_head_ownership_with_replication():
    c = cfg_of(8, 2)
    assert [list(kv_head_range(2, r, 4)) for r in range(4)] == [[0], [0], [1], [1]]  # each head on 2 ranks
    assert [list(q_head_range(c, r, 4)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert kv_replicas(2, 4) == 2 and kv_replicas(4, 2) == 1
    assert [list(kv_head_range(4, r, 2)) for r in range(2)] == [[0, 1], [2, 3]]
    assert [list(kv_head_range(3, r, 3)) for r in range(3)] == [[0], [1], [2]]  # SmolLM2 at TP=3
    for size in (1, 2, 4, 8):  # every rank's query heads use (GQA group) the KV heads it holds
        for r in range(size):
            groups = {h // (8 // 2) for h in q_head_range(c, r, size)}
            assert groups <= set(kv_head_range(2, r, size))


def test_local_config_and_kv_spec():
    c = cfg_of(8, 2)
    lc = local_config(c, 3, 4)
    assert (lc.num_heads, lc.num_kv_heads, lc.intermediate_size, lc.head_dim) == (2, 1, 36, c.head_dim)
    spec = KVPageSpec(2, 2, 8, 16, "float32")
    shards = [shard_kv_spec(spec, r, 4) for r in range(4)]
    assert all(s.num_kv_heads == 1 and s.tp_size == 4 for s in shards)
    assert len({s.signature() for s in shards} | {spec.signature()}) == 5  # the signature covers the shard
    assert spec.signature() == KVPageSpec(2, 2, 8, 16, "float32").signature()  # unsharded: unchanged


@pytest.fixture(scope="module")
def tiny84(tmp_path_factory):
    return write_tiny("llama", tmp_path_factory.mktemp("tp") / "l84", num_attention_heads=8,
                      num_key_value_heads=2, initializer_range=0.1)


@pytest.mark.parametrize("size", [2, 4])
def test_shards_reassemble_the_full_weights(tiny84, size):
    cfg, full = load_config(tiny84), load_weights(tiny84)
    shards = [shard_weights(full, cfg, r, size) for r in range(size)]
    for name, t in full.items():
        parts = [s[name] for s in shards]
        if "o_proj" in name or "down_proj" in name:
            assert torch.equal(torch.cat(parts, 1), t), name
        elif "k_proj" in name or "v_proj" in name:  # replicated when size > KV heads: take each head once
            step = kv_replicas(cfg.num_kv_heads, size)
            assert torch.equal(torch.cat(parts[::step], 0), t), name
        elif any(k in name for k in ("q_proj", "gate_proj", "up_proj")):
            assert torch.equal(torch.cat(parts, 0), t), name
        else:
            assert all(p is t for p in parts), name


@pytest.mark.parametrize("size", [2, 4])
def test_sharded_forward_equals_full_forward(tiny84, size):
    cfg, full = load_config(tiny84), load_weights(tiny84)
    spec = KVPageSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 8, "float32")
    ids = list(MIXED)
    reference = run_forward(LlamaForward(cfg, full, torch.float32), spec, ids)
    logits = tp_forward(cfg, full, spec, ids, size)  # every rank sums in the same order: identical logits
    assert (logits - reference).abs().max() < 1e-4
    assert torch.equal(torch.argmax(logits, -1), torch.argmax(reference, -1))


def test_local_config_is_a_plain_replace():
    c = cfg_of(9, 3)
    assert local_config(c, 0, 1) == c
    assert dataclasses.replace(c, num_heads=3, num_kv_heads=1, intermediate_size=c.intermediate_size // 3) \
        == local_config(c, 2, 3)


def test_rank_device_and_head_slices():
    from engine.parallel.kv_io import _heads_slice
    from engine.parallel.rank_worker import rank_device

    assert rank_device("cuda", 2) == torch.device("cuda:2") and rank_device("cuda:0", 2) == torch.device("cuda:0")
    assert rank_device("cpu", 3) == torch.device("cpu")
    cells = torch.arange(3 * 4 * 2, dtype=torch.uint8).view(3, 4, 2)  # [tokens, heads 4..7, cell bytes]
    got = _heads_slice(cells.numpy().tobytes(), 3, range(4, 8), 5, 7, 2)
    assert got == cells[:, 1:3].contiguous().numpy().tobytes()
