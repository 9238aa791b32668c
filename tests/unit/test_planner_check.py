"""cluster/planner/calibrate/bench_check.py (bench/checks/planner_check.py's library): the planner's
simulator replays what a bench probe sent on a spec's pools, and the comparison table applies issue 11's
bounds (attainment within 5 points; P90s within 15% / 25%)."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from cluster.planner.calibrate import bench_check as pc
from cluster.planner.inputs.workload import Request
from cluster.planner.sim.metrics import SLO
from cluster.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]

SLO_ = SLO(2.0, 0.15, 0.9)


def _requests(rate: float, n: int = 40, seed: int = 0) -> list[Request]:
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(Request(t, rng.randint(128, 384), rng.randint(16, 64)))
        t += rng.expovariate(rate)
    return out


def _bench_json(spec, rates, scale_ttft=1.0) -> dict:
    """A bench.json whose 'measured' records are the simulator's own results (optionally skewed)."""
    runs = []
    for rate in rates:
        reqs = _requests(rate)
        sim = pc.simulate_spec(spec, reqs, "cpu-local-smollm2", "cpu-local")
        recs = [{"arrival_s": q.arrival, "input_len": q.input_len, "max_tokens": q.output_len, "ok": True,
                 "ttft_ms": 1000 * r.ttft * scale_ttft, "tpot_ms": 1000 * r.tpot} for q, r in zip(reqs, sim.results)]
        runs.append({"rate": rate, "requests": recs})
    return {"targets": [{"label": "x", "runs": runs}]}


@pytest.mark.parametrize("path", ["deploy/local.yaml", "deploy/colocated.yaml"])
def test_replaying_the_simulator_agrees_with_itself(path):
    spec = load_spec(ROOT / path)
    rows = pc.compare(_bench_json(spec, [0.3, 0.6, 0.9]), spec, "cpu-local-smollm2", "cpu-local", SLO_)
    assert [r.rate for r in rows] == [0.3, 0.6, 0.9] and [r.bound for r in rows] == list(pc.BOUNDS)
    for r in rows:
        e = r.errors()
        assert e["attainment_points"] == pytest.approx(0.0) and e["ttft_p90"] == pytest.approx(0.0, abs=1e-9)
        assert r.passed() and r.predicted["ttft_p90_ms"] > 100  # a real prefill, not zero
    assert "| 0.3 |" in pc.table(rows) and "NO" not in pc.table(rows)


def test_a_skewed_measurement_fails_its_bound():
    spec = load_spec(ROOT / "deploy/local.yaml")
    rows = pc.compare(_bench_json(spec, [0.3, 0.6, 0.9], scale_ttft=1.2), spec, "cpu-local-smollm2",
                      "cpu-local", SLO_)
    # 20% off: outside 15% at the first two rates, inside 25% at the third
    assert [r.passed() for r in rows] == [False, False, True]
    assert rows[0].errors()["ttft_p90"] == pytest.approx(1 / 6, rel=1e-6)  # |1 - 1.2| / 1.2
    assert "NO" in pc.table(rows)


def test_more_replicas_predict_less_queueing():
    one = load_spec(ROOT / "deploy/colocated.yaml")
    reqs = _requests(3.0)
    two = pc.simulate_spec(one, reqs, "cpu-local-smollm2", "cpu-local")
    pools = one.pools.model_copy(update={"colocated": one.pools.colocated.model_copy(update={"replicas": 1})})
    single = one.model_copy(update={"pools": pools})
    alone = pc.simulate_spec(single, reqs, "cpu-local-smollm2", "cpu-local")
    assert alone.percentiles((90,))["ttft_p90"] > two.percentiles((90,))["ttft_p90"]


def test_a_calibration_run_gives_a_profile_copy_with_its_modes_serving_entry(tmp_path):
    from tests.unit.test_planner_serving import COEFFS, bench_run

    src = tmp_path / "p.json"
    src.write_text(json.dumps({"name": "t", "model": "smollm2-135m", "hardware": "cpu-local",
                               "tp": {"1": {"prefill": list(COEFFS.prefill), "decode": list(COEFFS.decode)}}}))
    out = pc.calibrated_profile(str(src), {"targets": [{"runs": [bench_run(1.6, 1.3, 0.05)]}]}, tmp_path / "c" / "p.json")
    entry = json.loads(Path(out).read_text())["serving"]["disaggregated"]
    assert entry["prefill_factor"] == pytest.approx(1.6, rel=1e-3) and entry["decode_factor"] == pytest.approx(1.3, rel=1e-3)
    assert "serving" not in json.loads(src.read_text())  # the profile itself is left alone
