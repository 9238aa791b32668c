"""Planner data and latency models: model configs, hardware table, roofline sanity, profile fits."""
from __future__ import annotations

import json
import random

import pytest

from cluster.planner.calibrate.fit import fit_decode, fit_prefill
from cluster.planner.errors import BadConfigError, UnknownHardwareError, UnknownModelError
from cluster.planner.inputs.hardware import known_hardware, load_hardware
from cluster.planner.inputs.models import known_models, load_model
from cluster.planner.latency.base import Coeffs, FittedLatency, Parallel
from cluster.planner.latency.profiles import latency_model, load_profile
from cluster.planner.latency.roofline import RooflineLatency, calibrate

ALL_MODELS = ["llama-3-8b", "llama-3-70b", "qwen2.5-7b", "qwen2.5-72b", "mistral-7b", "opt-13b", "opt-66b",
              "opt-175b", "smollm2-135m"]


def test_every_listed_model_loads_and_its_shape_counts_to_its_stated_parameters():
    assert set(ALL_MODELS) <= set(known_models())
    for name in ALL_MODELS:
        m = load_model(name)
        assert m.counted_params == pytest.approx(m.params, rel=0.02), name
    assert load_model("llama-3-8b").kv_bytes_per_token("bfloat16") == 2 * 32 * 8 * 128 * 2


def test_hf_config_json_loads(tmp_path):
    cfg = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 512}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = load_model(str(tmp_path))
    assert (m.layers, m.heads, m.kv_heads, m.head_dim, m.max_positions) == (4, 4, 2, 16, 512)
    assert m.params == m.counted_params
    opt = {"model_type": "opt", "num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
           "ffn_dim": 128, "vocab_size": 50, "max_position_embeddings": 64}
    (tmp_path / "opt.json").write_text(json.dumps(opt))
    assert not load_model(str(tmp_path / "opt.json")).gated_mlp
    (tmp_path / "bad.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(BadConfigError, match="lacks 'num_attention_heads'"):
        load_model(str(tmp_path / "bad.json"))


def test_unknown_names_suggest_the_close_ones():
    with pytest.raises(UnknownModelError, match="did you mean llama-3-8b"):
        load_model("llama3-8b")
    with pytest.raises(UnknownHardwareError, match="did you mean h100"):
        load_hardware("h10")
    assert {"a100-80g", "h100-80g-sxm", "h200", "l40s", "cpu-local"} <= set(known_hardware())
    assert load_hardware("H100").name == load_hardware("h100-sxm").name == "h100-80g-sxm"
    assert load_hardware("h100", inter_node_gbs=3).inter_node_bw == 3e9


def test_roofline_decode_is_bandwidth_bound_and_big_prefill_compute_bound():
    m, hw = load_model("llama-3-8b"), load_hardware("h100")
    r = RooflineLatency(Parallel(1, 1), m, hw)
    assert r.is_memory_bound_decode(1, 1000) and r.is_memory_bound_decode(32, 32 * 1000)
    assert r.is_compute_bound_prefill(2048, 2048 ** 2) and r.is_compute_bound_prefill(8 * 512, 8 * 512 ** 2)
    # batch-1 decode ~ reading the weights once: 16 GB / (3.35 TB/s x 0.8) ~ 6 ms, plus overhead
    assert 0.005 < r.decode(1, 1000) < 0.012
    # decode barely grows with batch (weights dominate); prefill grows ~linearly with tokens
    assert r.decode(32, 32 * 1000) < 1.5 * r.decode(1, 1000)
    assert r.prefill(4096, 2 * 2048 ** 2) == pytest.approx(2 * r.prefill(2048, 2048 ** 2), rel=0.15)


def test_tensor_and_pipeline_parallel_effects():
    m, hw = load_model("llama-3-70b"), load_hardware("h100")
    tp2, tp4 = (RooflineLatency(Parallel(t, 1), m, hw) for t in (2, 4))
    assert tp4.prefill(2048, 2048 ** 2) < 0.6 * tp2.prefill(2048, 2048 ** 2)
    assert tp4.decode(16, 16000) < tp2.decode(16, 16000)
    pp = RooflineLatency(Parallel(2, 2), m, hw)
    # a pipeline takes new batches at stage time, but one batch still crosses every stage
    assert pp.prefill_interval(2048, 2048 ** 2) < 0.6 * pp.prefill(2048, 2048 ** 2)
    assert pp.prefill(2048, 2048 ** 2) >= tp2.prefill(2048, 2048 ** 2) * 0.95


def test_fitted_model_and_calibrated_roofline_from_a_profile(tmp_path):
    coeffs = Coeffs((0.02, 1e-3, 1e-8), (0.03, 1e-7, 1e-3))
    f = FittedLatency(Parallel(1, 1), coeffs)
    assert f.prefill(100, 1e4) == pytest.approx(0.02 + 0.1 + 1e-4)
    assert f.decode(4, 1000) == pytest.approx(0.03 + 1e-4 + 4e-3)
    m, hw = load_model("smollm2-135m"), load_hardware("cpu-local")
    cal = calibrate(m, hw, coeffs)
    r = RooflineLatency(Parallel(1, 1), m, hw, cal=cal)
    assert r.decode(1, 100) == pytest.approx(f.decode(1, 100), rel=0.25)
    prof = {"name": "t", "model": "smollm2-135m", "hardware": "cpu-local",
            "tp": {"1": {"prefill": list(coeffs.prefill), "decode": list(coeffs.decode)}}}
    (tmp_path / "p.json").write_text(json.dumps(prof))
    p = load_profile(str(tmp_path / "p.json"))
    assert isinstance(latency_model(m, hw, Parallel(1, 2), profile=p), FittedLatency)
    assert isinstance(latency_model(m, hw, Parallel(3, 1), profile=p), RooflineLatency)  # TP 3 unmeasured
    (tmp_path / "bad.json").write_text(json.dumps({**prof, "extra": 1}))
    with pytest.raises(BadConfigError, match="extra"):
        load_profile(str(tmp_path / "bad.json"))


def test_profile_fit_recovers_known_coefficients():
    rng = random.Random(0)
    pre = [(t, sq, (0.05 + 1e-3 * t + 2e-7 * sq) * rng.uniform(0.99, 1.01))
           for t, sq in [(n * k, k * n * n) for n in (16, 64, 256, 1024) for k in (1, 2, 4)]]
    f = fit_prefill(pre)
    assert f.coeffs == pytest.approx((0.05, 1e-3, 2e-7), rel=0.1)
    assert f.mean_rel_err < 0.01 and f.max_rel_err < 0.03
    dec = [(b, c, 0.03 + 2e-6 * c + 1e-3 * b) for b in (1, 4, 16, 32) for c in (b * 64, b * 512)]
    d = fit_decode(dec)
    assert d.coeffs == pytest.approx((0.03, 2e-6, 1e-3), rel=1e-6)
    flat = fit_decode([(b, c, 0.05 - 1e-6 * c) for b, c in [(1, 10), (2, 5000), (3, 9000), (4, 20)]])
    assert min(flat.coeffs) >= 0  # noise never fits a negative slope
