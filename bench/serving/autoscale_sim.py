"""The SLO autoscaler at GPU scale, in the planner's simulator: Llama-3-8B on H100 (the planner's GPU step
model, deploy/hardware.yaml), a colocated pool of TP1 replicas, the Azure conversation trace tiled into a
diurnal rate curve; autoscaled vs static peak provisioning, side by side, in one run.

    python bench/serving/autoscale_sim.py                 # defaults below; ~2-4 minutes on one core
    python bench/serving/autoscale_sim.py --compress 1    # the full 24 hours (about 12x longer)

Order: (1) arrivals: the trace's inter-arrival gaps (its bursts) tiled end to end and time-warped so their
rate follows rate(t) = peak x (low + (1 - low) x (1 - cos(2 pi (t - 4 h) / day)) / 2) (trough at 04:00,
peak at 16:00); each arrival keeps its trace row's (context, generated) lengths. `--compress k` plays the
day in 24/k hours: the same curve ramping k times faster (harder for an autoscaler: its interval, window,
cooldowns and a replica's start delay stay physical seconds). (2) static: the planner's capacity model
(`serving/autoscale_capacity.PlannerCapacity`, the same the live autoscaler uses) sizes the pool for the
peak rate with the trace's length mix, bumped until the simulated 15:00-17:00 stretch of the real arrivals
meets the SLO (they are burstier than the model's Poisson); the pool serves the whole day at that size.
(3) autoscaled: the live autoscaler's decision logic (`serving/autoscale_policy.Policy`) drives
`planner/sim/elastic` interval by interval, seeing only what a live one could (arrivals and finished requests
so far); a new replica serves `--start-delay-s` after the decision that asked for it (paid from the decision),
a removed one drains. (4) report: GPU-hours (and per 24 h), SLO attainment, scale events, and SLO misses among
requests that arrived inside a transition (from a decision until its replica serves plus one interval, or
until the drained one is released), as a table, JSON and a plot of rate and replicas over time.
"""
from __future__ import annotations

import argparse
import bisect
import csv
import json
import math
import sys
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cluster.planner.inputs.hardware import load_hardware  # noqa: E402
from cluster.planner.inputs.models import load_model  # noqa: E402
from cluster.planner.inputs.workload import Request  # noqa: E402
from cluster.planner.latency.base import Parallel  # noqa: E402
from cluster.planner.latency.profiles import latency_model  # noqa: E402
from cluster.planner.search.configs import instance_memory  # noqa: E402
from cluster.planner.sim.coloc import ColocSetup  # noqa: E402
from cluster.planner.sim.elastic import ElasticView, simulate_elastic  # noqa: E402
from cluster.planner.sim.metrics import SLO  # noqa: E402
from cluster.serving.autoscale_capacity import PlannerCapacity  # noqa: E402
from cluster.serving.autoscale_policy import AutoscaleConfig, Finished, Load, Policy, Window  # noqa: E402

DAY = 86400.0
TRACE = ROOT / "data" / "workloads" / "azure_llm_2023_conv.csv"  # in the repository (data/README.md)


def read_trace(path: Path, max_len: int) -> tuple[list[float], list[tuple[int, int]]]:
    """Arrival times (s from the first) and (context, generated) lengths, clamped to `max_len` in all."""
    times, pairs = [], []
    with path.open() as f:
        for row in csv.DictReader(f):
            t = datetime.strptime(row["TIMESTAMP"][:26], "%Y-%m-%d %H:%M:%S.%f").timestamp()
            i, o = max(1, int(row["ContextTokens"])), max(1, int(row["GeneratedTokens"]))
            i = min(i, max_len - 64)
            times.append(t)
            pairs.append((i, min(o, max_len - i)))
    order = sorted(range(len(times)), key=times.__getitem__)
    t0 = times[order[0]]
    return [times[k] - t0 for k in order], [pairs[k] for k in order]


def diurnal(peak: float, low: float, day_s: float):
    return lambda t: peak * (low + (1 - low) * (1 - math.cos(2 * math.pi * (t / day_s - 4 / 24))) / 2)


def diurnal_arrivals(times, pairs, rate, day_s: float) -> list[Request]:
    """The trace tiled and time-warped onto `rate(t)`: trace time tau runs at the trace's mean rate r0,
    wall time t where integral_0^t rate / r0 = tau."""
    span = times[-1] + (times[-1] - times[0]) / max(1, len(times) - 1)
    r0 = len(times) / span
    grid, lam, acc, dt = [0.0], [0.0], 0.0, 1.0
    t = 0.0
    while t < day_s:
        acc += rate(t + dt / 2) / r0 * dt
        t += dt
        grid.append(t)
        lam.append(acc)
    out, tile = [], 0
    while True:
        for k, tau0 in enumerate(times):
            tau = tile * span + tau0
            if tau >= lam[-1]:
                return out
            j = bisect.bisect_left(lam, tau)
            a = grid[j - 1] + (tau - lam[j - 1]) / max(lam[j] - lam[j - 1], 1e-12) * dt if j else 0.0
            out.append(Request(a, *pairs[k]))
        tile += 1


class Controller:
    """The live autoscaler's policy on what the simulated pool has seen so far."""

    def __init__(self, policy: Policy, window_s: float):
        self.policy, self.window_s, self.log = policy, window_s, []

    def __call__(self, now: float, v: ElasticView) -> int:
        start = max(0.0, now - self.window_s)
        reqs = v.requests
        lo = bisect.bisect_left(reqs, start, 0, v.arrived, key=lambda r: r.arrival)
        arrivals = tuple((r.arrival, r.input_len, r.output_len) for r in reqs[lo:v.arrived])
        done = []
        for i in reversed(v.finished):
            if v.done[i] < start:
                break
            r = reqs[i]
            tpot = (v.done[i] - v.first[i]) / (r.output_len - 1) if r.output_len > 1 else None
            done.append(Finished(r.arrival, r.input_len, r.output_len, v.first[i] - r.arrival, tpot))
        busy = frozenset({"colocated"}) if v.serving != v.target or v.draining else frozenset()
        d = self.policy.step(Window(now, start, arrivals, tuple(reversed(done)), busy), {"colocated": v.target})[0]
        self.log.append(d)
        return d.target


def static_replicas(reqs, setup, slo: SLO, capacity, peak: Load, day_s: float, top: int) -> int:
    """Peak provisioning as an operator would size it: from the model's count at the peak rate, the fewest
    replicas whose simulated attainment over the day's busiest two hours (15:00-17:00 of the compressed
    day, around the 16:00 peak; on the real tiled arrivals: burstier than Poisson) reaches the target."""
    from cluster.planner.sim.coloc import simulate_colocated

    a, b = day_s * 15 / 24, day_s * 17 / 24
    busy = [r._replace(arrival=r.arrival - a) for r in reqs if a <= r.arrival < b]
    n = min(top, capacity.needed("colocated", peak, 1.0, (1, top)))
    while n < top and simulate_colocated(busy, [setup] * n).attainment(slo) < slo.attainment:
        n += 1
    return n


def transition_spans(events, start_delay_s: float, interval_s: float) -> list[tuple[float, float]]:
    return [(t, t + (start_delay_s if b > a else 0.0) + interval_s) for t, a, b in events]


def summarize(name, res, slo: SLO, spans, compress: float) -> dict:
    r = res.result.results
    ok = [x.ttft <= slo.ttft_s and x.tpot <= slo.tpot_s for x in r]
    inside = [any(a <= x.arrival < b for a, b in spans) for x in r]
    misses = len(ok) - sum(ok)
    return {"run": name, "requests": len(r), "gpu_hours": res.replica_seconds / 3600,
            "gpu_hours_per_24h": res.replica_seconds / 3600 * compress, "attainment": sum(ok) / len(ok),
            "ttft_attainment": res.result.ttft_attainment(slo), "tpot_attainment": res.result.tpot_attainment(slo),
            "scale_events": len(res.events), "misses": misses,
            "misses_in_transitions": sum(1 for k, i in zip(ok, inside) if not k and i),
            "requests_in_transitions": sum(inside), "peak_replicas": max(n for _, n, _ in res.timeline)}


def plot(path: Path, rate, day_s: float, runs: dict, compress: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    hours = lambda t: t / 3600 * compress  # noqa: E731
    xs = [k * day_s / 400 for k in range(401)]
    ax2 = ax.twinx()
    ax2.plot([hours(t) for t in xs], [rate(t) for t in xs], color="gray", lw=1, label="arrival rate")
    ax2.set_ylabel("req/s")
    for name, res in runs.items():
        ax.step([hours(t) for t, _, _ in res.timeline], [n for _, n, _ in res.timeline], where="post", label=name)
    ax.set_xlabel("hour of the (compressed) day")
    ax.set_ylabel("replicas (H100)")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--peak-rate", type=float, default=40.0, help="req/s at 16:00")
    ap.add_argument("--low", type=float, default=0.2, help="trough rate as a fraction of the peak")
    ap.add_argument("--compress", type=float, default=12.0, help="play the 24 h curve in 24/compress hours")
    ap.add_argument("--interval-s", type=float, default=30.0)
    ap.add_argument("--window-s", type=float, default=180.0)
    ap.add_argument("--up-cooldown-s", type=float, default=60.0)
    ap.add_argument("--down-cooldown-s", type=float, default=300.0)
    ap.add_argument("--start-delay-s", type=float, default=60.0, help="decision -> the new replica serves")
    ap.add_argument("--max-replicas", type=int, default=12)
    ap.add_argument("--ttft-ms", type=float, default=500.0)
    ap.add_argument("--tpot-ms", type=float, default=50.0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "autoscale-sim"))
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    model, hw = load_model("llama-3-8b"), load_hardware("h100-80g-sxm")
    mem = instance_memory(model, hw, Parallel(1, 1))
    setup = ColocSetup(latency_model(model, hw, Parallel(1, 1), mode="colocated"), mem.kv_tokens, 2048, 256)
    slo = SLO(a.ttft_ms / 1000, a.tpot_ms / 1000, 0.9)
    capacity = PlannerCapacity({"colocated": setup}, slo)
    times, pairs = read_trace(Path(a.trace), model.max_positions)
    day_s = DAY / a.compress
    rate = diurnal(a.peak_rate, a.low, day_s)
    reqs = diurnal_arrivals(times, pairs, rate, day_s)
    mix = tuple(pairs[:: max(1, len(pairs) // 200)])
    static_n = static_replicas(reqs, setup, slo, capacity, Load(a.peak_rate, a.peak_rate, a.peak_rate, mix),
                               day_s, a.max_replicas)
    print(f"{len(reqs)} requests over {day_s / 3600:.2f} h (the 24 h curve compressed {a.compress:g}x), peak "
          f"{a.peak_rate:g} req/s, trough {a.peak_rate * a.low:g}; SLO TTFT {a.ttft_ms:g} ms / TPOT {a.tpot_ms:g} ms "
          f"at 90%; Llama-3-8B TP1 on H100 ({mem.kv_tokens} KV tokens); static peak provisioning: {static_n} "
          f"replicas", flush=True)
    t0 = time.perf_counter()
    static = simulate_elastic(reqs, setup, lambda now, v: static_n, a.interval_s, a.start_delay_s, static_n)
    print(f"static run {time.perf_counter() - t0:.0f} s", flush=True)
    cfg = AutoscaleConfig({"colocated": (1, a.max_replicas)}, a.interval_s, a.window_s, a.up_cooldown_s,
                          a.down_cooldown_s, 0.2, 3, 10, 0.5, 0.9, slo.ttft_s, slo.tpot_s)
    ctl = Controller(Policy(cfg, capacity), a.window_s)
    initial = capacity.needed("colocated", Load(rate(0.0), rate(0.0), rate(0.0), mix), 1.0, (1, a.max_replicas))
    t0 = time.perf_counter()
    auto = simulate_elastic(reqs, setup, ctl, a.interval_s, a.start_delay_s, initial)
    print(f"autoscaled run {time.perf_counter() - t0:.0f} s", flush=True)
    rows = [summarize("static peak", static, slo, [], a.compress),
            summarize("autoscaled", auto, slo, transition_spans(auto.events, a.start_delay_s, a.interval_s),
                      a.compress)]
    print(f"\n{'run':<12} {'GPU-h':>7} {'GPU-h/24h':>9} {'attain':>7} {'TTFT':>6} {'TPOT':>6} {'events':>6} "
          f"{'misses':>7} {'in trans.':>9} {'peak n':>6}")
    for r in rows:
        print(f"{r['run']:<12} {r['gpu_hours']:7.2f} {r['gpu_hours_per_24h']:9.1f} {r['attainment']:7.2%} "
              f"{r['ttft_attainment']:6.1%} {r['tpot_attainment']:6.1%} {r['scale_events']:6d} {r['misses']:7d} "
              f"{r['misses_in_transitions']:9d} {r['peak_replicas']:6d}")
    s, au = rows
    reasons = {}
    for d in ctl.log:
        reasons[f"{d.direction}/{d.reason}"] = reasons.get(f"{d.direction}/{d.reason}", 0) + 1
    print(f"\nautoscaled / static GPU-hours: {au['gpu_hours'] / s['gpu_hours']:.3f}x; attainment "
          f"{au['attainment']:.2%} vs {s['attainment']:.2%}; {au['scale_events']} scale events, "
          f"{au['misses_in_transitions']} of {au['misses']} misses inside transitions "
          f"({au['requests_in_transitions']} requests arrived inside one); final correction factor "
          f"{ctl.policy.state('colocated').correction:.2f}; decisions {reasons}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps({"args": vars(a), "static_replicas": static_n, "runs": rows,
                                                  "events": auto.events, "decisions": reasons}, indent=1))
    plot(out / "replicas.png", rate, day_s, {"static peak": static, "autoscaled": auto}, a.compress)
    print(f"wrote {out / 'summary.json'}, {out / 'replicas.png'} ({time.perf_counter() - t_start:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
