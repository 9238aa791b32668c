"""bench/gpu/disagg_check.py on CPU with a tiny model: the disaggregated handoff over loopback gRPC (layer-wise
and held) gives the colocated reference's greedy tokens, both engines end empty, no push thread is left --
also with page_io's device path forced (the code CUDA pages take: staging buffers, `ready()` waited on by the
push thread); and the bf16 comparison reports the first divergence with the reference's top-2 logit gap."""
from __future__ import annotations

import threading

import pytest
import torch

from bench.gpu.disagg_check import Check, check, compare
from engine.kv_cache import page_io
from tests.conftest import assert_engine_empty


@pytest.mark.parametrize("device_path", [False, True])
def test_handoff_over_grpc_equals_one_engine_and_leaks_nothing(tmp_path, monkeypatch, device_path):
    if device_path:
        monkeypatch.setattr(page_io, "_on_host", lambda backend, layer: False)
    c = Check("tiny", dtype="float32", prompts=3, prompt_len=20, tokens=8, page_size=4)
    checked = []

    def idle(llm):
        assert_engine_empty(llm)
        checked.append(llm)

    r = check(c, tmp_path, idle_check=idle)
    assert len(checked) == 2  # the prefill engine and the decode engine
    assert r["ok"] and r["layer-wise"]["equal"] and r["held"]["equal"]
    assert r["layer-wise"]["compared"] == r["held"]["compared"] == 3 * 8
    kv = checked[0].kv_spec
    assert r["held"]["bytes"] == r["layer-wise"]["bytes"] == 3 * 20 * kv.bytes_per_token_layer() * kv.num_layers
    assert r["bare_grpc"]["bytes"] == r["held"]["bytes"] and r["held_vs_bare"] > 0
    assert not [t for t in threading.enumerate() if t.name.startswith("kv-push")], "push threads left"


def test_divergences_are_reported_with_the_top2_gap():
    c = Check("tiny", dtype="bfloat16")
    top2 = [torch.tensor([[3.0, 1.0], [2.0, 1.5], [1.0, 0.0]])] * 2
    assert compare(c, [[1, 2, 3], [4, 5, 6]], top2, [[1, 2, 3], [4, 5, 6]]) == {"equal": True, "compared": 6}
    r = compare(c, [[1, 2, 3], [4, 5, 6]], top2, [[1, 2, 3], [4, 9, 6]])
    assert not r["equal"] and r["first_divergence"] == {"prompt": 1, "position": 1, "top2_gap": 0.5}
    f32 = compare(Check("tiny", dtype="float32"), [[1, 2, 3]], top2[:1], [[1, 9, 3]])  # gap 0.5: no near-tie
    assert not f32["equal"] and "not a near-tie" in f32["first_divergence"]
