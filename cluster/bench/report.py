"""Bench output: `bench.json` (every request, every summary), `summary.md`, and PNG figures.

    write_report(result, out_dir) -> {name: path}     # runner.BenchResult in, files out

Figures (matplotlib, Agg backend, imported here only):
    attainment_vs_rate.png      one line per target, SLO attainment against request rate (DistServe style),
                                dashed line at the attainment target
    ttft_cdf.png, tpot_cdf.png  per target, at the highest rate every target measured (else its lowest)
    qoe_cdf.png                 per target at that rate, the CDF of per-request Andes QoE (qoe.py; failed
                                requests at 0), dashed line at the 0.9 cut the summary counts
    goodput_vs_slo_scale.png    --compare: each spec's goodput and the ratio A/B as the SLO scale goes
                                1.5x..10x; read off the measured rates (crossing interpolated linearly
                                between the bracketing rates), no extra runs

Comparison (`compare_summary`): a spec with `--set` variants counts with its best variant (highest goodput
at the declared SLO), so the baseline is the tuned one; every variant stays in the table and the JSON.
Timelines (pdserve targets): each server event as ms after the client sent the request; `phase_means`
averages them per target, which shows where time goes (queue, prefill, transfer, decode).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

from cluster.bench.metrics import RatePoint, attainment, goodput_from_points, request_metrics
from cluster.bench.qoe import GOOD, QoESetting, request_qoe
from cluster.bench.runner import BenchResult, RateRun, TargetResult
from cluster.serving_api import TIMELINE_COUNTS


def _clean(x):
    """JSON-safe: NaN/inf -> None, tuples -> lists, Paths -> str."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    return x


def record_json(r, qoe: QoESetting | None = None) -> dict:
    m = request_metrics(r)
    ms = lambda v: None if v is None else round(1000.0 * v, 3)  # noqa: E731
    out = {"index": r.index, "arrival_s": round(r.arrival_s, 4), "input_len": r.input_len,
           "max_tokens": r.max_tokens, "ok": m.ok, "error": r.error, "finish_reason": r.finish_reason,
           "sent_s": r.sent_s, "ttft_ms": ms(m.ttft_s), "tpot_ms": ms(m.tpot_s), "e2e_ms": ms(m.e2e_s),
           "output_tokens": r.output_tokens, "prompt_tokens": r.prompt_tokens,
           "chunk_ms": [round(1000.0 * (t - r.sent_s), 2) for t in r.chunk_s] if r.sent_s is not None else [],
           "chunk_tokens": r.chunk_tokens}
    if qoe is not None:
        out["qoe"] = round(request_qoe(r, qoe), 4)
    times = {k: v for k, v in (r.timeline or {}).items() if k not in TIMELINE_COUNTS}
    if times and r.sent_unix is not None:
        out["timeline_ms"] = {k: round(1000.0 * (v - r.sent_unix), 2) for k, v in sorted(times.items(),
                                                                                           key=lambda kv: kv[1])}
    counts = {k: int(r.timeline[k]) for k in TIMELINE_COUNTS if r.timeline and k in r.timeline}
    if counts:
        out["kv"] = counts  # per-request KV bytes shipped / peak pages held (pdserve cluster)
    return out


def phase_means(records) -> dict[str, float]:
    """Mean ms after send of each server timeline event (and the client's first token and end)."""
    sums: dict[str, list[float]] = {}
    for r in records:
        j = record_json(r)
        events = dict(j.get("timeline_ms") or {})
        if j["ok"]:
            events["client_first_token"] = j["ttft_ms"]
            events["client_end"] = j["e2e_ms"]
        for k, v in events.items():
            sums.setdefault(k, []).append(v)
    means = {k: sum(v) / len(v) for k, v in sums.items()}
    return dict(sorted(means.items(), key=lambda kv: kv[1]))


def _run_json(run: RateRun, qoe: QoESetting | None = None) -> dict:
    return {"rate": run.rate, "stopped_early": run.stopped_early,
            "summary": asdict(run.summary) if run.summary else None, "server_delta": run.server,
            "phases_ms": phase_means(run.records), "requests": [record_json(r, qoe) for r in run.records]}


def write_probe(out_dir: Path, t: TargetResult, run: RateRun, qoe: QoESetting | None = None) -> Path:
    """One probe's records as soon as it ends (`probes/<label>@<rate>.json`): a long run that dies or is
    interrupted keeps what it measured."""
    path = out_dir / "probes" / f"{t.label}@{run.rate if run.rate is not None else 'trace'}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_clean(dict(_run_json(run, qoe), label=t.label)), indent=1))
    return path


def target_json(t: TargetResult, qoe: QoESetting | None = None) -> dict:
    return {"label": t.label, "group": t.group, "spec": t.spec, "settings": t.settings,
            "goodput": asdict(t.goodput) if t.goodput else None, "server_log": t.server_log,
            "base_url": t.base_url, "error": t.error,
            "unloaded": [record_json(r, qoe) for r in t.unloaded], "runs": [_run_json(r, qoe) for r in t.runs]}


# ---- comparison ---------------------------------------------------------------------------------
def goodput_at(t: TargetResult, ttft_s: float, tpot_s: float, target: float, interpolate: bool) -> float:
    pts = [RatePoint(r.rate, attainment([request_metrics(x) for x in r.records], ttft_s, tpot_s))
           for r in t.runs if r.rate]
    return goodput_from_points(pts, target, interpolate)[0]


def groups(result: BenchResult) -> dict[str, list[TargetResult]]:
    out: dict[str, list[TargetResult]] = {}
    for t in result.targets:
        out.setdefault(t.group or t.label, []).append(t)
    return out


def compare_summary(result: BenchResult, order: list[str]) -> dict | None:
    """Goodput A/B at the declared SLO (best variant per spec) and across SLO scales."""
    g = groups(result)
    if len(order) != 2 or not all(k in g for k in order) or result.slo is None:
        return None
    slo, target = result.slo, result.config.target_attainment
    best = {k: max(g[k], key=lambda t: t.goodput.goodput if t.goodput else 0.0) for k in order}
    a, b = (best[k].goodput.goodput if best[k].goodput else 0.0 for k in order)
    sweep = []
    for s in result.config.slo_scales:
        ga, gb = (max(goodput_at(t, s * slo.ref_ttft_s, s * slo.ref_tpot_s, target, True) for t in g[k])
                  for k in order)
        sweep.append({"scale": s, "goodput_a": ga, "goodput_b": gb, "ratio": ga / gb if gb > 0 else None})
    return {"a": order[0], "b": order[1], "best_variant_a": best[order[0]].label,
            "best_variant_b": best[order[1]].label, "goodput_a": a, "goodput_b": b,
            "ratio": a / b if b > 0 else None, "slo_scale_sweep": sweep}


# ---- markdown ---------------------------------------------------------------------------------
def _f(x, fmt=".0f") -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def markdown(result: BenchResult, compare: dict | None) -> str:
    slo = result.slo
    lines = [f"# pdserve bench: {result.workload.name}", "",
             f"SLO: TTFT {_f(slo.ttft_s * 1000)} ms, TPOT {_f(slo.tpot_s * 1000, '.1f')} ms ({slo.source}); "
             f"attainment target {result.config.target_attainment:g}", "",
             *(["**Interrupted**: only the probes finished before Ctrl-C are reported.", ""]
               if result.interrupted else []),
             "| target | rate (req/s) | attainment | ok/sent | TTFT p50 / p90 (ms) | TPOT p50 / p90 (ms) "
             "| out tok/s |", "|---|---|---|---|---|---|---|"]
    for t in result.targets:
        for r in t.runs:
            s = r.summary
            att = f"{s.attainment:.2f}" + ("*" if r.stopped_early else "")
            lines.append(f"| {t.label} | {_f(r.rate, '.3g')} | {att} | {s.completed}/{s.requests} "
                         f"| {_f(s.ttft_ms['p50'])} / {_f(s.ttft_ms['p90'])} "
                         f"| {_f(s.tpot_ms['p50'], '.1f')} / {_f(s.tpot_ms['p90'], '.1f')} "
                         f"| {_f(s.output_throughput, '.1f')} |")
    if any(r.stopped_early for t in result.targets for r in t.runs):
        lines += ["", "\\* stopped early: below the target at every SLO scale; cancelled requests count as misses"]
    lines += ["", "| target | goodput (req/s) | note |", "|---|---|---|"]
    for t in result.targets:
        gp = t.goodput
        note = "lower bound: every measured rate attained" if gp and gp.bound == "above" else \
            (t.error or "").split("\n")[0][:120].replace("|", "/")
        lines.append(f"| {t.label} | {_f(gp.goodput if gp else None, '.3g')} | {note} |")
    if compare:
        lines += ["", f"**Goodput ratio {compare['a']} / {compare['b']}: {_f(compare['ratio'], '.2f')}** "
                  f"({_f(compare['goodput_a'], '.3g')} vs {_f(compare['goodput_b'], '.3g')} req/s; best variants "
                  f"{compare['best_variant_a']}, {compare['best_variant_b']})", "",
                  "Across SLO scales (goodput read off the measured rates, interpolated between the bracketing "
                  "ones; a spec counts with its best variant at each scale):", "",
                  "| SLO scale | goodput A | goodput B | ratio |", "|---|---|---|---|"]
        lines += [f"| {x['scale']:g}x | {_f(x['goodput_a'], '.3g')} | {_f(x['goodput_b'], '.3g')} "
                  f"| {_f(x['ratio'], '.2f')} |" for x in compare["slo_scale_sweep"]]
    lines += qoe_lines(result)
    lines += server_lines(result)
    lines += ["", "Mean ms after send per event (highest rate each target measured):", ""]
    for t in result.targets:
        if t.runs:
            phases = phase_means(t.runs[-1].records)
            lines.append(f"- {t.label}: " + ", ".join(f"{k} {v:.0f}" for k, v in phases.items()))
    return "\n".join(lines) + "\n"


def qoe_lines(result: BenchResult) -> list[str]:
    """Andes QoE per probe (qoe.py): the pace it was judged against, mean, low tail, share >= 0.9."""
    rows = [(t, r) for t in result.targets for r in t.runs if r.summary and r.summary.qoe]
    if not rows:
        return []
    q = result.config.qoe
    out = ["", f"QoE (Andes, arXiv 2404.16283): a reader expecting the first token {q.ttft_s:g} s after sending, "
           f"then {q.tds:g} tokens/s; 1 = no token read late, failed requests 0 (`--qoe-ttft`, `--qoe-pace`):", "",
           f"| target | rate (req/s) | QoE mean | p10 | p50 | min | share >= {GOOD:g} |",
           "|---|---|---|---|---|---|---|"]
    for t, r in rows:
        s = r.summary.qoe
        out.append(f"| {t.label} | {_f(r.rate, '.3g')} | {_f(s['mean'], '.3f')} | {_f(s['p10'], '.3f')} "
                   f"| {_f(s['p50'], '.3f')} | {_f(s['min'], '.3f')} | {_f(s['share_good'], '.2f')} |")
    return out


def server_lines(result: BenchResult) -> list[str]:
    """Per probe, what the server counted (change over the probe): KV bytes moved, backend statistics
    such as prefix-cache hits, preemptions; one row per counter (there are many: per worker), one column
    per probe. Empty when no target exposed /metrics."""
    probes = [(t, r) for t in result.targets for r in t.runs if r.server]
    keys = sorted({k for _, r in probes for k in r.server
                   if not k.startswith(("pdserve_requests_total", "pdserve_http_errors"))})
    if not keys:
        return []
    out = ["", "Server counters, change over each probe (from /metrics):", "",
           "| counter | " + " | ".join(f"{t.label} @ {_f(r.rate, '.3g')}" for t, r in probes) + " |",
           "|---|" + "---|" * len(probes)]
    for k in keys:
        name = k.replace("pdserve_backend_stat{name=", "").replace("pdserve_", "").rstrip("}")
        out.append(f"| {name} | " + " | ".join(_f(r.server.get(k), ".4g") for _, r in probes) + " |")
    return out


# ---- figures ----------------------------------------------------------------------------------
def _cdf_runs(result: BenchResult) -> list[tuple[TargetResult, RateRun]]:
    rate_sets = [{r.rate for r in t.runs} for t in result.targets if t.runs]
    common = set.intersection(*rate_sets) if rate_sets else set()
    out = []
    for t in result.targets:
        if not t.runs:
            continue
        pick = [r for r in t.runs if r.rate == max(common, key=lambda x: x or 0.0)] if common else []
        out.append((t, pick[0] if pick else t.runs[0]))
    return out


def plot(result: BenchResult, compare: dict | None, out_dir: Path) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = {}
    fig, ax = plt.subplots(figsize=(6, 4))
    for t in result.targets:
        pts = sorted((r.rate, r.summary.attainment) for r in t.runs if r.rate)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=t.label)
    ax.axhline(result.config.target_attainment, ls="--", c="gray", lw=1)
    ax.set(xlabel="request rate (req/s)", ylabel="SLO attainment", ylim=(-0.02, 1.02),
           title=f"{result.workload.name}: attainment vs rate")
    ax.legend(fontsize=8)
    files["attainment_vs_rate"] = _save(fig, out_dir / "attainment_vs_rate.png")
    for key, slo_s in (("ttft", result.slo.ttft_s), ("tpot", result.slo.tpot_s)):
        fig, ax = plt.subplots(figsize=(6, 4))
        for t, run in _cdf_runs(result):
            vals = sorted(1000 * getattr(request_metrics(r), f"{key}_s") for r in run.records
                          if getattr(request_metrics(r), f"{key}_s") is not None)
            if vals:
                ax.step(vals, [(i + 1) / len(vals) for i in range(len(vals))], where="post",
                        label=f"{t.label} @ {_f(run.rate, '.3g')} req/s")
        ax.axvline(1000 * slo_s, ls="--", c="gray", lw=1)
        ax.set(xlabel=f"{key.upper()} (ms)", ylabel="CDF", ylim=(0, 1.02), title=f"{key.upper()} CDF")
        ax.legend(fontsize=8)
        files[f"{key}_cdf"] = _save(fig, out_dir / f"{key}_cdf.png")
    files["qoe_cdf"] = _plot_qoe(plt, result, out_dir / "qoe_cdf.png")
    if compare:
        files["goodput_vs_slo_scale"] = _plot_sweep(plt, result, compare, out_dir / "goodput_vs_slo_scale.png")
    return files


def _plot_qoe(plt, result: BenchResult, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    for t, run in _cdf_runs(result):
        vals = sorted(request_qoe(r, result.config.qoe) for r in run.records)
        if vals:
            ax.step(vals, [(i + 1) / len(vals) for i in range(len(vals))], where="post",
                    label=f"{t.label} @ {_f(run.rate, '.3g')} req/s (mean {sum(vals) / len(vals):.2f})")
    ax.axvline(GOOD, ls="--", c="gray", lw=1)
    q = result.config.qoe
    ax.set(xlabel="QoE per request", ylabel="CDF", xlim=(-0.02, 1.02), ylim=(0, 1.02),
           title=f"Andes QoE CDF (expected TTFT {q.ttft_s:g} s, {q.tds:g} tok/s)")
    ax.legend(fontsize=8)
    return _save(fig, path)


def _plot_sweep(plt, result: BenchResult, compare: dict, path: Path) -> Path:
    sw = compare["slo_scale_sweep"]
    unit = "x unloaded p90" if result.config.needs_unloaded else "x declared SLO"
    declared = result.slo.ttft_s / result.slo.ref_ttft_s if result.slo.ref_ttft_s else None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [x["scale"] for x in sw]
    ax1.plot(xs, [x["goodput_a"] for x in sw], marker="o", label=compare["a"])
    ax1.plot(xs, [x["goodput_b"] for x in sw], marker="s", label=compare["b"])
    ax1.set(xlabel=f"SLO scale ({unit})", ylabel="goodput (req/s)",
            title="goodput vs SLO scale (interpolated between measured rates)")
    ax1.legend(fontsize=8)
    ax2.plot(xs, [x["ratio"] if x["ratio"] is not None else math.nan for x in sw], marker="o")
    ax2.axhline(1.0, ls="--", c="gray", lw=1)
    ax2.set(xlabel=f"SLO scale ({unit})", ylabel=f"goodput {compare['a']} / {compare['b']}",
            title="goodput ratio vs SLO scale")
    for ax in (ax1, ax2):
        if declared:
            ax.axvline(declared, ls=":", c="red", lw=1)
        ax.title.set_fontsize(9)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def write_report(result: BenchResult, out_dir: Path, compare_order: list[str] | None = None,
                 args: dict | None = None) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    compare = compare_summary(result, compare_order) if compare_order else None
    cfg = asdict(result.config)
    doc = {"args": args, "interrupted": result.interrupted, "config": cfg, "workload": dict(result.workload.info, name=result.workload.name),
           "slo": asdict(result.slo) if result.slo else None, "compare": compare,
           "targets": [target_json(t, result.config.qoe) for t in result.targets]}
    files = {"json": out_dir / "bench.json", "markdown": out_dir / "summary.md"}
    files["json"].write_text(json.dumps(_clean(doc), indent=1))
    files["markdown"].write_text(markdown(result, compare))
    files.update(plot(result, compare, out_dir))
    return files
