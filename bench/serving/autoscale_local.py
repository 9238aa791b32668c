"""The SLO autoscaler here, end to end: `pdserve serve` on deploy/colocated.yaml, 1..2 replicas autoscaled vs
a static 2-replica run, on the same arrivals, side by side in one run.

    python bench/serving/autoscale_local.py                   # ~15 min per run (two runs); needs a quiet machine
    python bench/serving/autoscale_local.py --minutes 2       # a smoke run

Arrivals: the Azure conversation trace's arrival pattern (its gaps, `cluster.bench.workload`, lengths
scaled to CPU: --input-scale / --output-scale) with its rate stepped low -> high -> low over thirds of
`--minutes` (the trace's own pattern time-warped onto each step's rate), open loop (`cluster.bench.loadgen`).
--input-scale auto (the default) fits each trace's prompts to one size: its mean prompt becomes the conversation
trace's at x0.25 (~254 tokens), the size the rates were chosen for (what two replicas serve here). Another
trace then brings its own arrival pattern and length mix at the same mean prompt: the code trace's prompts
(mean 2,122 tokens, twice the conversation's) at x0.25 would need more replicas than the bench allows even
at a steady 2 req/s -- a static 2-replica run would miss the SLO too, and the comparison would measure the
overload, not the autoscaler. A number sets the scale itself.
The two servers are the same spec with `--set`-style overrides (`cluster.bench.server.spec_variants`):
    both        pools.colocated.resources.num_cpus=0.5 -- deploy specs give a replica 1 CPU, and the local Ray
                gets this machine's cores (2 here), so a second replica may not be placeable beside the
                first while Ray counts the router's own work; half a CPU each is how a user fits two (each
                engine still runs one torch thread); slo.ttft_ms / slo.tpot_ms = --ttft-ms / --tpot-ms (the
                planner's CPU profile puts SmolLM2's p90 TPOT at ~170 ms even unloaded: the spec's 150 ms
                is out of its reach, so the autoscaler would only ever ask for more)
    static      pools.colocated.replicas=2
    autoscaled  replicas=1, max_replicas=2, autoscaling {enabled, interval_s, window_s, cooldowns, pools
                colocated [1, 2]} (time-compressed: --interval-s etc.)
Measured per run: SLO attainment (both targets, client side), worker-seconds (the live replica count polled
from /metrics once a second, integrated over the run; static: 2 x the run), requests failed (any error; a
failure in the autoscaled run while a resize was under way counts as failed by a scale event), the scale
events and the autoscaler's decisions (/metrics). Output: a table, ratios (the issue's targets: attainment
>= 90% at worker-seconds <= 0.75x of static, 0 failed by a scale event), JSON and a plot of replicas and
rolling attainment over time.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import yaml  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from cluster.bench.loadgen import Target, run_load  # noqa: E402
from cluster.bench.metrics import meets, request_metrics  # noqa: E402
from cluster.bench.prompts import PromptSource, load_tokenizer  # noqa: E402
from cluster.bench.server import SpecServer, spec_variants  # noqa: E402
from cluster.bench.workload import RequestSpec, TraceScaling, load_workload  # noqa: E402


TRACE = ROOT / "data" / "workloads" / "azure_llm_2023_conv.csv"  # in the repository (data/README.md)
REFERENCE_SCALE = 0.25  # --input-scale auto: every trace's mean prompt = TRACE's mean prompt x this


def mean_prompt(trace: str, n: int) -> float:
    """The trace's mean prompt length over its first n requests, unscaled."""
    raw = load_workload(trace, n, scaling=TraceScaling(1.0, 1.0, max_input=10**9, max_output=10**9))
    return sum(raw.input_lens) / len(raw.input_lens)


def fitted_input_scale(trace: str, n: int = 19000) -> float:
    """The input scale that gives `trace` the reference trace's mean prompt at REFERENCE_SCALE."""
    return REFERENCE_SCALE * mean_prompt(str(TRACE), n) / mean_prompt(trace, n)


def stepped_arrivals(unit_arrivals: list[float], rates: list[float], duration_s: float) -> list[float]:
    """The k-th equal part of the run gets the trace's next rates[k] x part arrivals, their gaps scaled by
    one factor so that they fill the part: each step has its rate, and within it the trace's pattern."""
    part, out, start = duration_s / len(rates), [], 0
    for k, r in enumerate(rates):
        n = max(1, round(r * part))
        chunk = unit_arrivals[start:start + n + 1]  # (+1: the gap after the last one is part of the span)
        start += n
        t0, span = chunk[0], (chunk[-1] - chunk[0]) or 1.0
        out += [k * part + (t - t0) / span * part for t in chunk[:n]]
    return out


def variants(spec: str, a, tmp: Path) -> dict[str, str]:
    common = [f"pools.colocated.resources.num_cpus={a.num_cpus}", f"slo.ttft_ms={a.ttft_ms}",
              f"slo.tpot_ms={a.tpot_ms}"]
    static = spec_variants([spec], common + ["pools.colocated.replicas=2"], tmp)[0][0].path
    auto = spec_variants([spec], common + ["pools.colocated.replicas=1", "pools.colocated.max_replicas=2"], tmp)[0][0]
    doc = yaml.safe_load(Path(auto.path).read_text())
    doc["autoscaling"] = {"enabled": True, "interval_s": a.interval_s, "window_s": a.window_s,
                          "scale_up_cooldown_s": a.up_cooldown_s, "scale_down_cooldown_s": a.down_cooldown_s,
                          "scale_down_stable_intervals": 2, "min_samples": 5,
                          "pools": {"colocated": {"min_replicas": 1, "max_replicas": 2}}}
    path = tmp / "colocated-autoscaled.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return {"static": static, "autoscaled": str(path)}


class MetricsPoller(threading.Thread):
    """Every second: the pool's live workers and the autoscaler's target (from /metrics)."""

    def __init__(self, base_url: str):
        super().__init__(daemon=True)
        self.url, self.samples, self.stop_flag, self.last = f"{base_url}/metrics", [], threading.Event(), {}

    def run(self) -> None:
        with httpx.Client(timeout=5.0) as c:
            while not self.stop_flag.is_set():
                try:
                    self.last = scrape(c.get(self.url).text)
                    self.samples.append((time.perf_counter(), self.last.get("live", 0.0),  # (perf_counter:
                                         self.last.get("target", 0.0)))  # the load's clock, see run_one)
                except httpx.HTTPError:
                    pass
                self.stop_flag.wait(1.0)


def scrape(text: str) -> dict:
    out = {"decisions": {}}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "pdserve_backend_stat" and s.labels.get("name") == "pool_colocated_live":
                out["live"] = s.value
            elif s.name == "pdserve_autoscaler_target_replicas":
                out["target"] = s.value
            elif s.name == "pdserve_autoscaler_decisions_total":
                out["decisions"][f"{s.labels['direction']}/{s.labels['reason']}"] = s.value
            elif s.name == "pdserve_backend_stat" and s.labels.get("name") == "requests_failed":
                out["failed"] = s.value
    return out


def run_one(name: str, spec_path: str, reqs: list[RequestSpec], prompts: PromptSource, out: Path, a) -> dict:
    with SpecServer(spec_path, out / f"{name}.log") as srv:
        poller = MetricsPoller(srv.base_url)
        poller.start()
        t0 = time.perf_counter()  # (run_load's own t0 is a few ms later: its prompts are built first)
        records = asyncio.run(run_load(reqs, prompts.prompt, Target(srv.base_url, srv.model, pdserve=True,
                                                                        timeout_s=a.timeout_s)))
        took = time.perf_counter() - t0
        time.sleep(1.5)
        poller.stop_flag.set()
        poller.join()
    ms = [request_metrics(r) for r in records]
    ok = [meets(m, a.ttft_ms / 1000, a.tpot_ms / 1000) for m in ms]
    samples = [(t - t0, n, m) for t, n, m in poller.samples if 0 <= t - t0 <= took]  # the run only
    worker_s = sum((b[0] - x[0]) * x[1] for x, b in zip(samples, samples[1:]))
    if name == "static":
        worker_s = 2 * took
    changes = [(t, n) for (t, n, _), (_, m, _) in zip(samples[1:], samples) if n != m]
    return {"run": name, "requests": len(records), "seconds": took, "attainment": sum(ok) / len(ok),
            "failed": sum(1 for r in records if r.error is not None), "worker_seconds": worker_s,
            "replica_changes": changes, "decisions": poller.last.get("decisions", {}),
            "errors": sorted({r.error for r in records if r.error})[:5],
            "series": {"replicas": [(t, n) for t, n, _ in samples],
                       "ok": [(r.arrival_s, k) for r, k in zip(records, ok)]}}


def plot(path: Path, runs: list[dict], rates, duration_s: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for r in runs:
        ts, ns = zip(*r["series"]["replicas"]) if r["series"]["replicas"] else ((), ())
        ax1.step(ts, ns, where="post", label=r["run"])
        oks = sorted(r["series"]["ok"])
        xs = [t for t, _ in oks]
        roll = [sum(k for s, k in oks if t - 60 <= s <= t) / max(1, sum(1 for s, _ in oks if t - 60 <= s <= t))
                for t in xs]
        ax2.plot(xs, roll, label=r["run"])
    part = duration_s / len(rates)
    for k, rate in enumerate(rates):
        ax1.axvspan(k * part, (k + 1) * part, alpha=0.06 * (1 + k % 2), color="gray")
        ax1.text((k + 0.5) * part, 0.05, f"{rate:g} req/s", ha="center", transform=ax1.get_xaxis_transform())
    ax1.set_ylabel("live replicas")
    ax2.set_ylabel("SLO attainment (last 60 s)")
    ax2.set_xlabel("seconds")
    ax1.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", default=str(ROOT / "deploy" / "colocated.yaml"))
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--minutes", type=float, default=15.0, help="length of each run (low / high / low thirds)")
    # the high step within what 2 replicas serve here: at 2.5 req/s the static 2-replica run met the SLO for
    # only 59% of requests (a backlog from ~330 s to ~650 s) while the autoscaled one held: both runs were at
    # the edge of the machine, and the comparison measured which backlog happened to build, not the autoscaler
    ap.add_argument("--rates", default="0.4,2.0,0.4", help="req/s of each step (low, high, low)")
    ap.add_argument("--input-scale", default="auto", help="prompt length scale, or auto (see the module map)")
    ap.add_argument("--output-scale", type=float, default=0.25)
    ap.add_argument("--num-cpus", type=float, default=0.5)
    ap.add_argument("--ttft-ms", type=float, default=3000.0)
    ap.add_argument("--tpot-ms", type=float, default=300.0)
    ap.add_argument("--interval-s", type=float, default=10.0)
    ap.add_argument("--window-s", type=float, default=60.0)
    ap.add_argument("--up-cooldown-s", type=float, default=20.0)
    ap.add_argument("--down-cooldown-s", type=float, default=60.0)
    ap.add_argument("--timeout-s", type=float, default=120.0)
    ap.add_argument("--runs", default="autoscaled,static")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "autoscale-local"))
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rates = [float(x) for x in a.rates.split(",")]
    duration = a.minutes * 60
    a.input_scale = fitted_input_scale(a.trace) if a.input_scale == "auto" else float(a.input_scale)
    scaling = TraceScaling(a.input_scale, a.output_scale, max_input=1024, max_output=128)
    wl = load_workload(a.trace, 19000, scaling=scaling)
    times = stepped_arrivals(wl.unit_arrivals_s, rates, duration)
    reqs = [RequestSpec(i, t, wl.input_lens[i], wl.output_lens[i]) for i, t in enumerate(times)]
    print(f"{len(reqs)} requests over {duration:.0f} s at {rates} req/s ({Path(a.trace).name}'s arrival pattern, lengths x"
          f"{a.input_scale:.3g}/x{a.output_scale:g}); SLO TTFT {a.ttft_ms:g} ms / TPOT {a.tpot_ms:g} ms", flush=True)
    prompts = PromptSource(load_tokenizer(yaml.safe_load(Path(a.spec).read_text())["model"]))
    paths = variants(a.spec, a, out)
    results = []
    for name in a.runs.split(","):
        print(f"--- {name}: {paths[name]}", flush=True)
        results.append(run_one(name, paths[name], reqs, prompts, out, a))
        r = results[-1]
        print(f"{name}: attainment {r['attainment']:.1%}, worker-seconds {r['worker_seconds']:.0f}, failed "
              f"{r['failed']} {r['errors']}, replica changes {[(round(t), n) for t, n in r['replica_changes']]}, "
              f"decisions {r['decisions']}", flush=True)
    by = {r["run"]: r for r in results}
    if {"static", "autoscaled"} <= by.keys():
        s, au = by["static"], by["autoscaled"]
        print(f"\nautoscaled vs static 2 replicas: worker-seconds {au['worker_seconds'] / s['worker_seconds']:.3f}x "
              f"(target <= 0.75x), attainment {au['attainment']:.1%} vs {s['attainment']:.1%} (target >= 90%), "
              f"failed {au['failed']} vs {s['failed']} (target 0 by a scale event)")
    elif "autoscaled" in by:  # static's worker-seconds are 2 x its run by construction: the ratio without it
        au = by["autoscaled"]
        print(f"\nautoscaled vs static 2 replicas (2 x {au['seconds']:.0f} s, not run): worker-seconds "
              f"{au['worker_seconds'] / (2 * au['seconds']):.3f}x (target <= 0.75x), attainment {au['attainment']:.1%}"
              f" (target >= 90%), failed {au['failed']}")
    (out / "summary.json").write_text(json.dumps({"args": vars(a), "runs": results}, indent=1))
    plot(out / "replicas_attainment.png", results, rates, duration)
    print(f"wrote {out / 'summary.json'}, {out / 'replicas_attainment.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
