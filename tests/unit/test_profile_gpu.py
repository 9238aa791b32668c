"""`pdserve profile`'s GPU path on CPU (the gpu-tiny grid), random:<name> models, the fit's forms on GPU-shaped
steps, and bench/gpu/profile_check.py's predictions (issue 32's profile row). No wall-clock asserts."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pytest

from cluster.planner.calibrate import profiler
from cluster.planner.calibrate.fit import fit_decode, fit_prefill
from cluster.planner.calibrate.random_model import model_shapes, random_llm, random_model_dir
from cluster.planner.errors import BadConfigError
from tests.conftest import assert_engine_empty

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(name="tiny", layers=2, hidden=64, heads=8, kv_heads=2, head_dim=8, ffn=128, vocab=256,
            max_positions=512, tied_embeddings=False)


@pytest.fixture
def tiny_deploy(tmp_path, monkeypatch):
    """A deploy dir whose models/ holds `tiny`: random:tiny is a 2-layer Llama."""
    (tmp_path / "deploy" / "models").mkdir(parents=True)
    (tmp_path / "deploy" / "models" / "tiny.yaml").write_text(json.dumps(TINY))
    monkeypatch.setenv("PDSERVE_DEPLOY_DIR", str(tmp_path / "deploy"))
    return tmp_path


def test_random_model_shapes_and_unknown_name(tiny_deploy):
    shapes = model_shapes(TINY)
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == (16, 64) and shapes["lm_head.weight"] == (256, 64)
    assert len(shapes) == 3 + 2 * 9
    d, _ = random_model_dir("tiny", tiny_deploy / "m")
    assert json.loads((d / "config.json").read_text())["num_key_value_heads"] == 2
    with pytest.raises(BadConfigError, match="known: tiny"):
        random_model_dir("nope", tiny_deploy / "n")


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "MixtralForCausalLM"])
def test_a_random_moe_entry_runs_as_its_own_architecture(tmp_path, arch):
    """random:qwen3-30b-a3b / mixtral-8x7b (bench/gpu/decode_floor.py's MoE rows): experts as fused tensors,
    Qwen3's q/k norms, every layer sparse; the engine loads it and decodes."""
    from engine import SamplingParams
    from engine.config import ModelConfig
    from cluster.planner.calibrate.random_model import hf_config

    m = dict(TINY, name="tiny-moe", architecture=arch, experts=4, experts_per_token=2, expert_ffn=32)
    shapes = model_shapes(m)
    assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == (4, 64, 64)
    assert shapes["model.layers.1.mlp.experts.down_proj"] == (4, 64, 32) and shapes["model.layers.1.mlp.gate.weight"] == (4, 64)
    assert "model.layers.0.mlp.gate_proj.weight" not in shapes
    assert ("model.layers.0.self_attn.q_norm.weight" in shapes) == (arch == "Qwen3MoeForCausalLM")
    cfg = ModelConfig.from_hf_dict(hf_config(m))
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.intermediate_size, cfg.moe.sparse_layers) == (4, 2, 32, (0, 1))
    llm = random_llm(m, tmp_path, dtype="float32", num_pages=16, page_size=16, max_num_seqs=2)
    assert all(lw.moe is not None for lw in llm.model.layers)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 3
    assert_engine_empty(llm)


def test_gpu_grid_path_on_cpu(tiny_deploy):
    """The GPU grid's measurement with random weights: prefill points fit one step (timed after one untimed
    repeat), decode prompts over several steps, contexts read from the engine, rows aborted, sync around
    every timed step; the engine ends empty."""
    import engine.llm as engine_llm

    real = engine_llm.load_weights
    spec, llm = profiler._engine_for(str(ROOT / "deploy" / "local.yaml"), "gpu-tiny", "cpu", "random:tiny",
                                     str(tiny_deploy / "tmp"))
    assert engine_llm.load_weights is real  # the swap is undone
    assert llm.scheduler.cfg.max_num_batched_tokens == profiler.GPU_GRIDS["gpu-tiny"]
    syncs = []
    pre, dec = profiler.measure(llm, "gpu-tiny", 1, time.perf_counter, log=lambda *_: None,
                                sync=lambda: syncs.append(1))
    prefill_grid, decode_grid = profiler.GRIDS["gpu-tiny"]
    assert [(t, sq) for t, sq, _ in pre] == [(sum(b), sum(n * n for n in b)) for b in prefill_grid]
    assert [b for b, *_ in dec] == [b for b, _ in decode_grid]  # one point per batch: its median step
    b, n = 4, 256  # 1024 prompt tokens over a 256-token budget: the chunked path
    (row,) = [p for p in dec if p[0] == b and p[1] >= b * n]
    assert row[1] >= b * (n + 1 + profiler.DECODE_SKIP)  # early rows decoded while the last prompts prefilled
    mid = (profiler.DECODE_STEPS - 1) / 2  # the median context: one token per row per step
    assert dec[0][1] == 64 + 1 + profiler.DECODE_SKIP + mid  # (1, 64): prefilled in one step
    timed = 1 + len(prefill_grid) * 2 + len(decode_grid) * profiler.DECODE_STEPS + 2  # warm-up, prefill x 2, decodes
    assert len(syncs) == 2 * timed
    assert all(s > 0 for *_, s in pre + dec)
    pf, df = fit_prefill(pre), fit_decode(dec)
    assert pf.points == len(prefill_grid) and df.points == len(dec)
    assert_engine_empty(llm)


def test_options_keep_cpu_defaults():
    def ns(**kw):
        return argparse.Namespace(**{"spec": "s.yaml", "grid": None, "clock": None, "device": "cpu", **kw})

    assert profiler.resolve_options(ns()) == ("cpu", "small", "cpu", None)
    assert profiler.resolve_options(ns(device="cuda", clock="cpu"))[3].startswith("--clock cpu")
    assert profiler.resolve_options(ns(device="tpu"))[3]
    assert profiler.resolve_options(ns(spec=None, model=None))[3].startswith("give a spec")
    assert profiler.resolve_options(ns(spec=None, model="random:x", device="cpu", grid="gpu-tiny"))[3] is None


def test_fit_forms_hold_on_gpu_shaped_steps():
    """The 3-term forms fit the planner's own H100 step model of Llama-3-8B over the gpu grid within 2%:
    decode is weights (a) + KV bytes (b*C) + per-row work (c*B); prefill compute-bound (b*T) + attention."""
    from cluster.planner.inputs.hardware import load_hardware
    from cluster.planner.inputs.models import load_model
    from cluster.planner.latency.base import Parallel
    from cluster.planner.latency.profiles import latency_model

    lm = latency_model(load_model("llama-3-8b"), load_hardware("h100"), Parallel(1, 1))
    prefill_grid, decode_grid = profiler.GRIDS["gpu"]
    pre = [(sum(b), sum(n * n for n in b)) for b in prefill_grid]
    pf = fit_prefill([(t, sq, lm.prefill(t, sq)) for t, sq in pre])
    df = fit_decode([(b, b * n, lm.decode(b, b * n)) for b, n in decode_grid])
    assert pf.max_rel_err < 0.02 and df.max_rel_err < 0.02


def test_profile_check_predicts_each_row(tmp_path):
    sys.path.insert(0, str(ROOT))
    from bench.gpu import profile_check as chk

    coeffs = {"prefill": [0.005, 3e-5, 5e-10], "decode": [0.006, 4e-8, 2e-5]}
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"name": "p", "model": "random:llama-3-8b", "hardware": "h100", "device": "cuda",
                                "tp": {"1": {**coeffs, "fit": {}}}}))
    a, b, c = coeffs["decode"]
    floor = tmp_path / "floor_x.json"
    floor.write_text(json.dumps({"model": "random:smollm2-135m", "rows": [
        {"batch": 16, "mode": "graphs", "context": 2047, "median_ms": (a + b * 16 * 2048 + c * 16) * 1e3},
        {"batch": 64, "mode": "graphs", "context": 2047, "median_ms": 2 * (a + b * 64 * 2048 + c * 64) * 1e3},
        {"batch": 64, "mode": "torch", "context": 2047, "median_ms": 99.0},
        {"batch": 64, "mode": "graphs", "context": 2047, "median_ms": 1.0, "kv": "int8"}]}))
    pa, pb, pc = coeffs["prefill"]
    steps = tmp_path / "steps_x.json"
    steps.write_text(json.dumps({"context": 1000, "cases": [
        {"phase": "prefill", "size": 2048, "steps": 5, "median_ms": (pa + pb * 2048 + pc * 2048 ** 2) * 1e3},
        {"phase": "decode", "size": 1, "steps": 12, "median_ms": (a + b * 1010 + c) * 1e3}]}))
    r = chk.check(str(prof), [floor, steps])
    assert [x["ratio"] for x in r["rows"]] == [1.0, 0.5, 1.0, 1.0] and not r["ok"]
    assert "1 outside" in chk.table(r) and r["warnings"] == [
        "floor_x.json measured random:smollm2-135m, the profile random:llama-3-8b"]
    assert chk.main(["--profile", str(prof), "--steps", str(steps)]) == 0
    assert chk.main(["--profile", str(prof), "--steps", str(floor)]) == 1
    assert chk.main(["--profile", str(prof), "--steps", str(tmp_path / "missing.json")]) == 2


def test_profile_command_without_spec_writes_a_profile_the_planner_reads(tiny_deploy, capsys):
    """`pdserve profile --model random:NAME` (no spec: the GPU machine has no pydantic) on the gpu-tiny grid."""
    from cluster import cli
    from cluster.planner.latency.profiles import load_profile

    out = tiny_deploy / "p.json"
    assert cli.main(["profile", "--model", "random:tiny", "--grid", "gpu-tiny", "--repeats", "1", "--corun-rounds",
                     "0", "--hardware", "cpu-dry", "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["model"] == "random:tiny" and d["dtype"] == "bfloat16" and "device" not in d and "corun" not in d
    assert d["notes"].startswith("pdserve profile --grid gpu-tiny")
    assert load_profile(str(out)).coeffs[1].decode == tuple(d["tp"]["1"]["decode"])
