"""Planner predictions against `pdserve bench` on the same spec, workload and SLO (issue 11's check).

    python bench/checks/planner_check.py --spec deploy/local.yaml --profile cpu-local-smollm2 \
        --workload random:input=256,output=64 --ttft-ms 2000 --tpot-ms 150 --rates 0.5,1,2 --out DIR
    python bench/checks/planner_check.py ... --goodput 1.2           # skip the goodput search (measured before)
    python bench/checks/planner_check.py ... --from-bench DIR/bench.json   # re-predict a finished run, no server
    python bench/checks/planner_check.py ... --calibrate-rate 0.15  # serving calibration just before the probes

Order: (1) unless --goodput is given, `pdserve bench --spec` bisects the spec's measured goodput at the
SLO; (2) `pdserve bench` probes 25%, 50% and 75% of it (--fractions), no bisection, no early stop;
(3) for each probe, the planner's simulator replays exactly what the bench sent (each request's arrival,
prompt length and max_tokens from bench.json) on the spec's pools (replicas, token budget, sequence cap,
KV pages) with the profile's latency model; (4) a table: SLO attainment (measured vs predicted, points),
P90 TTFT and P90 TPOT (relative error), each against the issue's bound: attainment within 5 points, P90s
within 15% at the first two rates and 25% at the third.

With --calibrate-rate R, a low-rate run (other arrivals: seed + 1000) right before the probes calibrates
the profile's serving overheads for the spec's mode (`cluster/planner/calibrate/serving_fit.py`, written to
DIR/profile.json) and the prediction uses them: on a shared machine a calibration from another hour is
off by the drift between the two.

Why replay the bench's own requests instead of Poisson draws: the comparison is then about the latency
model and the simulator, not about two different samples of arrivals. Imports the planner (pure) and
the spec (pydantic); the bench runs as a child process (`pdserve bench`).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
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
from cluster.planner.sim.metrics import SLO, SimResult, percentile
from cluster.spec import ClusterSpec, load_spec

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


def _bench(args, out: Path, rates: list[float], bisect: int, seed: int | None = None) -> dict:
    cmd = [sys.executable, "-m", "cluster.cli", "bench", "--spec", args.spec, "--workload", args.workload,
           "--num-requests", str(args.num_requests), "--ttft-ms", str(args.ttft_ms), "--tpot-ms", str(args.tpot_ms),
           "--rates", ",".join(f"{r:.4g}" for r in rates), "--bisect", str(bisect), "--out", str(out),
           "--no-progress", "--no-early-stop", "--seed", str(args.seed if seed is None else seed)]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return json.loads((out / "bench.json").read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default="deploy/local.yaml")
    ap.add_argument("--profile", default="cpu-local-smollm2", help="latency profile (deploy/profiles/NAME.json)")
    ap.add_argument("--hardware", default="cpu-local")
    ap.add_argument("--workload", default="random:input=256,output=64")
    ap.add_argument("--num-requests", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ttft-ms", type=float, default=2000.0)
    ap.add_argument("--tpot-ms", type=float, default=150.0)
    ap.add_argument("--attainment", type=float, default=0.9)
    ap.add_argument("--rates", default="0.25,0.5,1,2", help="goodput search: starting rates")
    ap.add_argument("--goodput", type=float, help="measured goodput (req/s): skip the search")
    ap.add_argument("--fractions", default="0.25,0.5,0.75", help="probe rates as fractions of the goodput")
    ap.add_argument("--from-bench", help="a finished bench.json: only predict and compare")
    ap.add_argument("--corun", default="cpu", choices=["cpu", "wall", "off"],
                    help="the profile's co-run factors for replicas sharing this machine (as pdserve plan --corun)")
    ap.add_argument("--serving", default="off", choices=["on", "off"],
                    help="the profile's serving calibration (as pdserve plan --serving; take it with `pdserve "
                         "profile --serving-from` from a low-rate run just before this check)")
    ap.add_argument("--calibrate-rate", type=float,
                    help="req/s of a serving-calibration run just before the probes (implies --serving on)")
    ap.add_argument("--out", default="bench/out/planner-check")
    args = ap.parse_args(argv)
    spec, slo = load_spec(args.spec), SLO(args.ttft_ms / 1000, args.tpot_ms / 1000, args.attainment)
    out = Path(args.out)
    if args.from_bench:
        bench = json.loads(Path(args.from_bench).read_text())
    else:
        goodput = args.goodput
        if goodput is None:
            found = _bench(args, out / "goodput", [float(x) for x in args.rates.split(",")], 3)
            goodput = max(t["goodput"]["goodput"] for t in found["targets"] if t["goodput"])
            print(f"measured goodput: {goodput:.3g} req/s", flush=True)
        if goodput <= 0:
            print("planner_check: measured goodput is 0 at this SLO; loosen it", file=sys.stderr)
            return 2
        if args.calibrate_rate:
            cal = _bench(args, out / "calibration", [args.calibrate_rate], 0, seed=args.seed + 1000)
            args.profile, args.serving = calibrated_profile(args.profile, cal, out / "profile.json"), "on"
        bench = _bench(args, out / "probes", [f * goodput for f in map(float, args.fractions.split(","))], 0)
    rows = compare(bench, spec, args.profile, args.hardware, slo, args.corun, args.serving == "on")
    text = table(rows)
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / "planner_check.md").write_text(text + "\n")
    (out / "planner_check.json").write_text(json.dumps(
        [dict(rate=r.rate, measured=r.measured, predicted=r.predicted, errors=r.errors(), passed=r.passed())
         for r in rows], indent=1))
    return 0 if all(r.passed() for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
