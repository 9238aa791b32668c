"""Serving calibration (`cluster/planner/calibrate/serving_fit.py`): the runtime's overheads read off a bench run. The
calibration recovers known factors from synthetic bench records; the profile loader applies them (or not);
`admission_s` delays every request by exactly that much; a drift of all-ones spreads changes nothing, a
wide one spreads the P90s and is a pure function of its inputs."""
from __future__ import annotations

import json

import pytest

from cluster.planner.calibrate.serving_fit import calibrate_serving, spread
from cluster.planner.errors import BadConfigError
from cluster.planner.inputs.hardware import load_hardware
from cluster.planner.inputs.models import load_model
from cluster.planner.inputs.workload import Request, poisson_requests
from cluster.planner.latency.base import Coeffs, FittedLatency, Parallel
from cluster.planner.latency.drift import SPREAD_POINTS, Drift
from cluster.planner.latency.profiles import latency_model, load_profile
from cluster.planner.sim.coloc import ColocSetup, simulate_colocated
from cluster.planner.sim.disagg import DecodeSetup, Link, PrefillSetup, simulate_disaggregated

COEFFS = Coeffs(prefill=(0.05, 6e-4, 3e-7), decode=(0.066, 1e-5, 6e-5))
LINK = Link(kv_bytes_per_token=1000.0, bandwidth=1e12, layers=10)
ONES = tuple([1.0] * SPREAD_POINTS)


def bench_run(prefill_factor: float, decode_factor: float, admission_s: float, n: int = 12) -> dict:
    """A bench probe's records as `pdserve bench` writes them, from known factors (lengths vary)."""
    reqs = []
    for k in range(n):
        inp, out = 64 + 32 * k, 16 + k
        took = prefill_factor * (COEFFS.prefill[0] + COEFFS.prefill[1] * inp + COEFFS.prefill[2] * inp * inp)
        step = decode_factor * (COEFFS.decode[0] + COEFFS.decode[1] * (inp + out / 2) + COEFFS.decode[2])
        reqs.append({"ok": True, "input_len": inp, "output_tokens": out, "ttft_ms": 1000 * (took + admission_s),
                     "tpot_ms": 1000 * step,
                     "timeline_ms": {"reserved": 40.0, "prefill_start": 100.0, "prefill_end": 100.0 + 1000 * took}})
    return {"rate": 0.1, "requests": reqs}


def test_calibration_recovers_known_factors_per_mode_and_needs_timelines():
    entry = calibrate_serving([bench_run(1.8, 1.4, 0.06)], COEFFS, source="synthetic")
    assert entry["mode"] == "disaggregated"
    assert entry["prefill_factor"] == pytest.approx(1.8, rel=1e-3)
    assert entry["decode_factor"] == pytest.approx(1.4, rel=1e-3)
    assert entry["admission_s"] == pytest.approx(0.06, abs=1e-3)
    assert entry["prefill_spread"] == pytest.approx(list(ONES), rel=1e-3) and entry["points"] == 12
    colocated = bench_run(1.2, 1.1, 0.03)
    for r in colocated["requests"]:  # a colocated replica's events, as it reports them: no KV reservation
        took = r["timeline_ms"]["prefill_end"] - r["timeline_ms"]["prefill_start"]
        r["timeline_ms"] = {"queued": 1.0, "engine_added": 5.0, "prefill_start": 6.0, "prefill_end": 6.0 + took,
                            "first_token": 7.0 + took}
    entry = calibrate_serving([colocated], COEFFS)
    assert entry["mode"] == "colocated" and entry["prefill_factor"] == pytest.approx(1.2, rel=1e-3)
    with pytest.raises(BadConfigError, match="mix"):
        calibrate_serving([colocated, bench_run(1.0, 1.0, 0.0)], COEFFS)
    bare = bench_run(1.0, 1.0, 0.0)
    for r in bare["requests"]:
        r["timeline_ms"] = None  # a foreign server: no timelines
    with pytest.raises(BadConfigError, match="timelines"):
        calibrate_serving([bare], COEFFS)


def test_spread_is_normalised_quantiles():
    q = spread([1.0, 2.0, 3.0, 4.0, 5.0])
    assert len(q) == SPREAD_POINTS and q[0] == pytest.approx(1 / 3, abs=1e-4) and q[-1] == pytest.approx(5 / 3, abs=1e-4)
    assert q[SPREAD_POINTS // 2] == pytest.approx(1.0) and list(q) == sorted(q)


def write_profile(tmp_path, serving: dict):
    prof = {"name": "t", "model": "smollm2-135m", "hardware": "cpu-local",
            "tp": {"1": {"prefill": list(COEFFS.prefill), "decode": list(COEFFS.decode)}}, "serving": serving}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof))
    return str(path)


def test_the_latency_model_takes_its_modes_calibration_unless_told_not_to(tmp_path):
    entry = calibrate_serving([bench_run(2.0, 1.5, 0.08)], COEFFS)
    path = write_profile(tmp_path, {"disaggregated": entry})
    m, hw = load_model("smollm2-135m"), load_hardware("cpu-local")
    on, off = load_profile(path), load_profile(path, serving=False)
    for mode in ("disaggregated", "colocated"):  # colocated has no entry: it takes the nearest there is
        lat = latency_model(m, hw, Parallel(), profile=on, mode=mode)
        assert lat.coeffs.prefill == pytest.approx(tuple(2.0 * x for x in COEFFS.prefill), rel=1e-3)
        assert lat.coeffs.decode == pytest.approx(tuple(1.5 * x for x in COEFFS.decode), rel=1e-3)
        assert lat.admission_s == pytest.approx(0.08, abs=1e-3) and lat.drift is not None
    bare = latency_model(m, hw, Parallel(), profile=off)
    assert bare.coeffs == COEFFS and bare.admission_s == 0.0 and bare.drift is None
    coloc = calibrate_serving([bench_run(1.0, 1.0, 0.0)], COEFFS)
    both = load_profile(write_profile(tmp_path, {"disaggregated": entry, "colocated": coloc}))
    assert latency_model(m, hw, Parallel(), profile=both, mode="colocated").coeffs == pytest.approx(COEFFS)
    bad = dict(entry, prefill_spread=[1.0, 0.5] + [1.0] * (SPREAD_POINTS - 2))  # not non-decreasing
    with pytest.raises(BadConfigError, match="spread"):
        load_profile(write_profile(tmp_path, {"disaggregated": bad}))
    with pytest.raises(BadConfigError, match="mode"):
        load_profile(write_profile(tmp_path, {"pipelined": entry}))


def test_admission_delays_each_request_by_exactly_that_much():
    reqs = [Request(0.0, 300, 20), Request(50.0, 500, 10)]  # far apart: no queueing

    def both(admission: float):
        lat = FittedLatency(Parallel(), COEFFS, admission_s=admission)
        dis = simulate_disaggregated(reqs, [PrefillSetup(lat, 512, 8)], [DecodeSetup(lat, 10_000, 8)], LINK)
        col = simulate_colocated(reqs, [ColocSetup(lat, 10_000, 512, 8)])
        return dis.results, col.results

    for plain, late in zip(both(0.0), both(0.25)):
        for a, b in zip(plain, late):
            assert b.ttft == pytest.approx(a.ttft + 0.25) and b.tpot == pytest.approx(a.tpot)


def simulate(drift: Drift | None, seed: int = 4):
    lat = FittedLatency(Parallel(), COEFFS, drift=drift)
    reqs = poisson_requests([(256, 32), (512, 16), (128, 64)], 2.0, 200, seed=seed)
    return simulate_disaggregated(reqs, [PrefillSetup(lat, 512, 8)], [DecodeSetup(lat, 20_000, 32)], LINK)


def test_a_flat_drift_changes_nothing_and_a_wide_one_spreads_the_tails():
    plain = simulate(None)
    flat = simulate(Drift(ONES, ONES, 0.4, 6.0))
    for a, b in zip(plain.results, flat.results):  # runs of steps are cut at window edges: same sums
        assert b.ttft == pytest.approx(a.ttft, rel=1e-9) and b.tpot == pytest.approx(a.tpot, rel=1e-9)
    wide_q = tuple(0.5 + k * 0.1 for k in range(SPREAD_POINTS))  # 0.5 .. 2.5, median 1.5
    wide = Drift(wide_q, wide_q, 0.4, 6.0)
    assert simulate(wide).results == simulate(wide).results  # seeded: deterministic
    p, w = plain.percentiles((50, 90)), simulate(wide).percentiles((50, 90))
    assert w["ttft_p90"] / w["ttft_p50"] > p["ttft_p90"] / p["ttft_p50"]
    assert min(wide_q) <= wide.factor("decode", 123.4) <= max(wide_q)
    assert wide.next_change("prefill", 1.0) == pytest.approx(1.2) and wide.next_change("decode", 5.9) == pytest.approx(6.0)
