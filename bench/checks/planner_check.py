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
model and the simulator, not about two different samples of arrivals. The replay and the comparison are
cluster/planner/calibrate/bench_check.py; the bench runs as a child process (`pdserve bench`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain script folder: make `cluster` importable without an install
    sys.path.insert(0, str(ROOT))

from cluster.planner.calibrate.bench_check import calibrated_profile, compare, table  # noqa: E402
from cluster.planner.sim.metrics import SLO  # noqa: E402
from cluster.spec import load_spec  # noqa: E402


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
