"""The planner's simulator on what a `pdserve bench` run sent (issue 11's check): each probe's requests
(arrival, prompt length, max_tokens from bench.json) replayed on a spec's pools (replicas, token budget,
sequence cap, KV pages; TP = PP = 1, what `serve` runs) with a profile's latency model, and the
prediction set beside what the bench measured. The library of bench/checks/planner_check.py (which
runs the bench and prints the table) and tests/unit/test_planner_check.py.

    simulate_spec(spec, requests, profile, hardware) -> SimResult
    compare(bench_json, spec, profile, hardware, slo) -> [Row]     one per probe, in rate order
    table(rows) -> markdown; Row.passed(): within BOUNDS (attainment points, P90 relative error)
    calibrated_profile(profile, bench_json, out)   the profile with that run's serving calibration

Why the bench's own requests and not Poisson draws: the comparison is then about the latency model
and the simulator, not about two samples of arrivals.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from cluster.planner.calibrate.serving_fit import add_serving
from cluster.planner.inputs.hardware import load_hardware
from cluster.planner.inputs.models import load_model
from cluster.planner.inputs.paths import read_data
from cluster.planner.inputs.workload import Request
from cluster.planner.latency.base import Parallel
from cluster.planner.latency.profiles import corun_of, latency_model, load_profile, profile_path
from cluster.planner.sim.bus import Sharing
from cluster.planner.sim.coloc import ColocSetup, simulate_colocated
from cluster.planner.sim.disagg import DecodeSetup, Link, PrefillSetup, simulate_disaggregated
from cluster.planner.sim.metrics import SLO, SimResult
from cluster.spec import ClusterSpec
from cluster.stats import percentile

BOUNDS = ((5.0, 0.15), (5.0, 0.15), (5.0, 0.25))  # (attainment points, P90 relative error) per probe


@dataclass
class Row:
    rate: float
    measured: dict  # attainment, ttft_p90_ms, tpot_p90_ms
    predicted: dict
    bound: tuple[float, float]

    def errors(self) -> dict:
        m, p = self.measured, self.predicted
        rel = lambda k: abs(p[k] - m[k]) / m[k] if m[k] else None  # noqa: E731
        return {"attainment_points": 100 * abs(p["attainment"] - m["attainment"]),
                "ttft_p90": rel("ttft_p90_ms"), "tpot_p90": rel("tpot_p90_ms")}

    def passed(self) -> bool:
        e = self.errors()
        return e["attainment_points"] <= self.bound[0] and all(
            e[k] is not None and e[k] <= self.bound[1] for k in ("ttft_p90", "tpot_p90"))


def simulate_spec(spec: ClusterSpec, requests: list[Request], profile: str | None, hardware: str,
                  corun: str = "cpu", serving: bool = True) -> SimResult:
    """The spec's pools in the planner's simulator (TP = PP = 1: what `serve` runs today)."""
    model, hw = load_model(spec.model), load_hardware(hardware)
    prof = load_profile(profile, corun, serving) if profile else None
    lat = latency_model(model, hw, Parallel(1, 1), spec.dtype, prof, mode=spec.mode)

    def kw(pool: str) -> dict:
        return spec.engine_kwargs(pool)

    pools = spec.pools_in_use()
    # every replica runs on this machine: one node, one memory bus (the profile's co-run factors)
    share = lambda n: Sharing(corun_of(prof), (0,) * n)  # noqa: E731
    if spec.mode == "colocated":
        k = kw("colocated")
        reps = [ColocSetup(lat, k["num_pages"] * k["page_size"], k["max_num_batched_tokens"], k["max_num_seqs"])]
        n = pools["colocated"].replicas
        return simulate_colocated(requests, reps * n, share(n))
    p, d = kw("prefill"), kw("decode")
    pre = [PrefillSetup(lat, p["max_num_batched_tokens"], p["max_num_seqs"])] * pools["prefill"].replicas
    dec = [DecodeSetup(lat, d["num_pages"] * d["page_size"], d["max_num_seqs"])] * pools["decode"].replicas
    link = Link(model.kv_bytes_per_token(spec.dtype), hw.intra_node_bw, model.layers)
    return simulate_disaggregated(requests, pre, dec, link, share(len(pre) + len(dec)))


def requests_of(run: dict) -> list[Request]:
    """What one bench probe sent: arrival, prompt length and max_tokens (ignore_eos: all generated)."""
    reqs = sorted(run["requests"], key=lambda r: r["arrival_s"])
    return [Request(r["arrival_s"], r["input_len"], r["max_tokens"]) for r in reqs]


def measured_of(run: dict, slo: SLO) -> dict:
    ok = [r for r in run["requests"] if r["ok"]]
    met = sum(1 for r in ok if r["ttft_ms"] <= 1000 * slo.ttft_s and (r["tpot_ms"] or 0.0) <= 1000 * slo.tpot_s)
    return {"attainment": met / len(run["requests"]),
            "ttft_p90_ms": percentile([r["ttft_ms"] for r in ok], 90) if ok else float("nan"),
            "tpot_p90_ms": percentile([r["tpot_ms"] or 0.0 for r in ok], 90) if ok else float("nan")}


def predicted_of(sim: SimResult, slo: SLO) -> dict:
    pct = sim.percentiles((90,))
    return {"attainment": sim.attainment(slo), "ttft_p90_ms": 1000 * pct["ttft_p90"],
            "tpot_p90_ms": 1000 * pct["tpot_p90"]}


def compare(bench: dict, spec: ClusterSpec, profile: str | None, hardware: str, slo: SLO,
            corun: str = "cpu", serving: bool = True) -> list[Row]:
    runs = sorted((r for t in bench["targets"] for r in t["runs"] if r["rate"]), key=lambda r: r["rate"])
    rows = []
    for i, run in enumerate(runs):
        sim = simulate_spec(spec, requests_of(run), profile, hardware, corun, serving)
        rows.append(Row(run["rate"], measured_of(run, slo), predicted_of(sim, slo), BOUNDS[min(i, len(BOUNDS) - 1)]))
    return rows


def table(rows: list[Row]) -> str:
    pct = lambda x: "-" if x is None else f"{100 * x:.0f}%"  # noqa: E731
    lines = ["| rate (req/s) | attainment meas / pred | P90 TTFT ms meas / pred | P90 TPOT ms meas / pred "
             "| errors (att pts, TTFT, TPOT) | bound | pass |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        m, p, e = r.measured, r.predicted, r.errors()
        lines.append(f"| {r.rate:.3g} | {m['attainment']:.2f} / {p['attainment']:.2f} "
                     f"| {m['ttft_p90_ms']:.0f} / {p['ttft_p90_ms']:.0f} | {m['tpot_p90_ms']:.1f} / {p['tpot_p90_ms']:.1f} "
                     f"| {e['attainment_points']:.1f}, {pct(e['ttft_p90'])}, {pct(e['tpot_p90'])} "
                     f"| {r.bound[0]:g} pts, {100 * r.bound[1]:.0f}% | {'yes' if r.passed() else 'NO'} |")
    return "\n".join(lines)


def calibrated_profile(profile: str, bench: dict, out: Path) -> str:
    """A copy of `profile` (a name or path) with the serving entry `bench`'s runs give, written to `out`."""
    data = read_data(profile_path(profile))
    entry = add_serving(data, [bench], source=str(out.parent))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"serving calibration ({entry['mode']}): prefill x{entry['prefill_factor']:.3f}, decode "
          f"x{entry['decode_factor']:.3f}, admission {1000 * entry['admission_s']:.0f} ms -> {out}", flush=True)
    return str(out)
