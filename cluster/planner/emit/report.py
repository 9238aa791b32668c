"""The planner's report: `DIR/report.md`, `DIR/attainment.png` (attainment vs rate), `DIR/plan.json`.

Reads a `SearchResult` (plans, per-instance goodputs, rejections) and the `PlanRequest`; simulates the
chosen plan and the best plan of the other mode over a range of rates (0.25x-2x the target) for the
plot; says which constraint binds and why the winning mode wins. When the best colocated plan uses fewer GPUs
than the best disaggregated one, it is also simulated scaled up to the same GPUs (`equal_gpus`): on a
node whose instances share a memory bus (co-run factors) per-GPU goodput of a plan that leaves devices
idle is not what a full node gets. matplotlib (Agg) is imported here only.
"""
from __future__ import annotations

import json
from pathlib import Path

from cluster.planner.search.plan_search import SearchResult
from cluster.planner.search.plans import Plan
from cluster.planner.search.probe import PlanProbe
from cluster.planner.search.request import PlanRequest
from cluster.stats import percentile


def equal_gpus(req: PlanRequest, best_d: Plan | None, best_c: Plan | None, whole: dict[str, float]) -> dict:
    """The best colocated replica kind scaled to the best disaggregated plan's GPUs, simulated whole
    ({} when not comparable: a mode missing, not simulated, or sizes that do not divide)."""
    if best_d is None or best_c is None or "disaggregated" not in whole or best_c.gpus >= best_d.gpus:
        return {}
    c, _ = best_c.pools[0]
    if best_d.gpus % c.parallel.gpus:
        return {}
    k = best_d.gpus // c.parallel.gpus
    scaled = Plan("colocated", "colocated", ((c, k),), best_d.gpus)
    return {"gpus": best_d.gpus, "replicas": k, "colocated": PlanProbe(req, scaled).goodput(),
            "disaggregated": whole["disaggregated"]}


def binding_constraint(req: PlanRequest, plan: Plan, whole: float | None = None) -> str:
    """Which pool limits the plan's goodput, and which SLO target it misses first above that rate;
    headroom from the whole-plan goodput when simulated (else from the per-instance goodputs)."""
    choice, n = min(plan.pools, key=lambda cn: cn[0].goodput * cn[1])
    what = {"ttft": f"TTFT {req.slo.ttft_s * 1000:g} ms", "tpot": f"TPOT {req.slo.tpot_s * 1000:g} ms",
            "throughput": "its throughput (no SLO target)"}
    headroom = (whole or choice.goodput * n) / req.rate - 1
    kv_note = ""
    if choice.phase != "prefill":
        mean_len = sum(i + o for i, o in req.pairs) / len(req.pairs)
        if choice.kv_tokens / mean_len < choice.max_seqs:
            kv_note = (f"; KV memory ({choice.kv_tokens} tokens, ~{choice.kv_tokens / mean_len:.0f} average "
                       f"requests) caps its batch below max_num_seqs {choice.max_seqs}")
    return (f"the {choice.phase} pool ({n} x {choice.parallel}, {choice.goodput:.2f} req/s each): "
            f"{what.get(choice.binding, choice.binding)} fails first above its goodput{kv_note}; "
            f"{headroom:.0%} headroom at {req.rate:g} req/s; GPUs: {plan.gpus} of {req.total_gpus}")


def why(best_d: Plan | None, best_c: Plan | None, whole: dict[str, float]) -> str:
    """Which mode serves more per GPU (whole-plan simulated goodput when both were simulated, else the
    per-instance goodputs at the ideal ratio), and the per-instance facts behind it."""
    if best_d is None or best_c is None:
        return "only one mode has a plan within the GPUs and the SLO"
    (pc, _), (dc, _) = best_d.pools
    cc, _ = best_c.pools[0]
    if "disaggregated" in whole and "colocated" in whole:
        d, c = whole["disaggregated"] / best_d.gpus, whole["colocated"] / best_c.gpus
        basis = "whole-plan simulated goodput per GPU"
    else:
        d, c = best_d.ideal_per_gpu_goodput, best_c.ideal_per_gpu_goodput
        basis = "per-instance goodput per GPU at the ideal ratio"
    facts = (f"one instance alone: prefill {pc.parallel} {pc.per_gpu:.2f} req/s per GPU (limited by "
             f"{pc.binding.upper()}), decode {dc.parallel} {dc.per_gpu:.2f} ({dc.binding.upper()}), "
             f"colocated {cc.parallel} {cc.per_gpu:.2f} ({cc.binding.upper()})")
    if d > c * 1.02:
        verdict = (f"disaggregation pays ({d:.2f} vs {c:.2f} req/s per GPU, {basis}): each phase runs at its "
                   f"own parallelism and decode steps never wait behind prompt chunks")
    elif c > d * 1.02:
        verdict = (f"colocation pays ({c:.2f} vs {d:.2f} req/s per GPU, {basis}): the TPOT target leaves room "
                   f"for prompt chunks to share steps with decode, decode tokens ride along on compute-bound "
                   f"chunks, and one pool of interchangeable replicas balances load better than two pools at a "
                   f"fixed ratio")
    else:
        verdict = f"a tie within 2% ({d:.2f} vs {c:.2f} req/s per GPU, {basis})"
    return f"{verdict}; {facts}"


def _plot(path: Path, req: PlanRequest, curves: dict[str, list[tuple[float, float]]]) -> list[str]:
    """Attainment vs rate per plan; returns the legend's labels (short: the report's table names the plans)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.6))
    for label, pts in curves.items():
        ax.plot([r for r, _ in pts], [a * 100 for _, a in pts], marker="o", label=label)
    ax.axhline(req.slo.attainment * 100, color="grey", linestyle="--", label="target attainment")
    ax.axvline(req.rate, color="grey", linestyle=":", label="target rate")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_title(f"{req.model.name} on {req.hw.name}: TTFT {req.slo.ttft_s * 1000:g} ms, "
                 f"TPOT {req.slo.tpot_s * 1000:g} ms", fontsize=9)
    # below the axes, never over the curves; labels are short (the report's table names the plans)
    legend = ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    labels = [t.get_text() for t in legend.get_texts()]
    plt.close(fig)
    return labels


def _percentile_rows(plan: Plan, req: PlanRequest) -> list[str]:
    if plan.result is None:
        return []
    p = plan.result.percentiles()
    return [f"| {m.upper()} | " + " | ".join(f"{p[f'{m}_p{q}'] * 1000:.1f}" for q in (50, 90, 99)) + " |"
            for m in ("ttft", "tpot", "e2e")]


def write_report(out_dir: str | Path, req: PlanRequest, res: SearchResult, inputs: dict,
                 spec_path: str) -> tuple[Path, dict]:
    """Write the report; returns its path and the plan.json summary."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    best = res.best
    best_d, best_c = res.best_of("disaggregated"), res.best_of("colocated")
    other = best_c if best.mode == "disaggregated" else best_d
    probes = {"chosen": PlanProbe(req, best)} | ({"other": PlanProbe(req, other)} if other else {})
    whole = {k: p.goodput() for k, p in probes.items()}
    # short labels in the plot (P1, P2), the full plans in the report's table beside it
    names = {f"P{k + 1} ({'chosen' if key == 'chosen' else 'best ' + p.plan.mode})": p.plan.describe()
             for k, (key, p) in enumerate(probes.items())}
    curves = {label: p.curve() for label, p in zip(names, probes.values())}
    _plot(out / "attainment.png", req, curves)
    whole_by_mode = {probes[k].plan.mode: g for k, g in whole.items()}
    equal = equal_gpus(req, best_d, best_c, whole_by_mode)
    md = _markdown(req, res, inputs, spec_path, best_d, best_c, curves, whole_by_mode, names)
    if equal:
        md += (f"\nOn equal GPUs ({equal['gpus']}): colocated x{equal['replicas']} {equal['colocated']:.2f} req/s vs "
               f"disaggregated {equal['disaggregated']:.2f} req/s (whole plans simulated, co-run slowdown included).\n")
    (out / "report.md").write_text(md)
    summary = _summary(req, res, inputs, best_d, best_c, whole_by_mode) | ({"equal_gpus": equal} if equal else {})
    (out / "plan.json").write_text(json.dumps(summary, indent=2))
    return out / "report.md", summary


def _plan_row(p: Plan) -> str:
    att = f"{p.attainment:.1%}" if p.attainment is not None else "not simulated"
    return (f"| {p.describe()} | {p.gpus} | {p.goodput:.2f} | {p.per_gpu_goodput:.2f} | "
            f"{p.ideal_per_gpu_goodput:.2f} | {att} |")


def _workload_line(req: PlanRequest) -> str:
    ins = [i for i, _ in req.pairs]
    outs = [o for _, o in req.pairs]
    return (f"input tokens p50 {percentile(ins, 50):g} / p90 {percentile(ins, 90):g} (mean {sum(ins) / len(ins):.0f}), "
            f"output tokens p50 {percentile(outs, 50):g} / p90 {percentile(outs, 90):g} (mean "
            f"{sum(outs) / len(outs):.0f}); Poisson arrivals")


def _markdown(req, res: SearchResult, inputs: dict, spec_path: str, best_d, best_c, curves, whole,
              names: dict[str, str]) -> str:
    best = res.best
    lines = [f"# pdserve plan: {req.model.name} on {req.nodes} x {req.gpus_per_node} {req.hw.name}", "",
             f"- command: `{inputs['command']}`",
             f"- workload: {inputs['workload']}: {_workload_line(req)}",
             f"- target: {req.rate:g} req/s with TTFT <= {req.slo.ttft_s * 1000:g} ms and TPOT <= "
             f"{req.slo.tpot_s * 1000:g} ms for {req.slo.attainment:.0%} of requests",
             f"- latency model: {inputs['latency']}", f"- search: {res.seconds:.1f} s ({'; '.join(res.notes)})", "",
             "## Chosen plan", "", f"**{best.describe()}** -> `{spec_path}`", ""]
    for c, n in best.pools:
        ep = f" x EP {c.parallel.ep}" if c.parallel.ep > 1 else ""  # expert groups (MoE decode pools)
        lines.append(f"- {n} x {c.phase}: TP {c.parallel.tp} x PP {c.parallel.pp}{ep}, token budget "
                     f"{c.token_budget or '-'}, max_num_seqs {c.max_seqs}, KV {c.kv_tokens} tokens per instance, "
                     f"goodput {c.goodput:.2f} req/s per instance")
    att = f"{best.attainment:.1%}" if best.attainment is not None else "n/a"
    lines += ["", f"Predicted goodput {best.goodput:.2f} req/s ({best.per_gpu_goodput:.2f} per GPU; "
                  f"{best.ideal_per_gpu_goodput:.2f} per GPU at the ideal ratio); simulated attainment at "
                  f"{req.rate:g} req/s: {att}.", "",
              f"**Binding constraint:** {binding_constraint(req, best, whole.get(best.mode))}.", "",
              "Predicted latencies at the target rate (ms):", "", "| | p50 | p90 | p99 |", "|---|---|---|---|",
              *_percentile_rows(best, req), "",
              "## Disaggregated vs colocated", ""]
    for label, p in (("best disaggregated", best_d), ("best colocated", best_c)):
        if p is not None:
            sim = (f"whole plan simulated: {whole[p.mode]:.2f} req/s = {whole[p.mode] / p.gpus:.2f} per GPU; "
                   if p.mode in whole else "")
            lines.append(f"- {label}: {p.describe()}: {sim}per-instance goodputs give {p.per_gpu_goodput:.2f} "
                         f"req/s per GPU ({p.ideal_per_gpu_goodput:.2f} at the ideal ratio)")
    lines += ["", f"Why: {why(best_d, best_c, whole)}.", "", "## Alternatives", "",
              "| plan | GPUs | goodput (req/s) | per GPU | per GPU, ideal ratio | attainment at target |",
              "|---|---|---|---|---|---|", *[_plan_row(p) for p in res.plans[:10]], "",
              "## Instances measured (fine pass)", "", "| kind | TP x PP | budget | goodput | per GPU | binds |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {c.phase} | {c.parallel} | {c.token_budget or '-'} | {c.goodput:.2f} | {c.per_gpu:.2f} | "
              f"{c.binding} |" for c in res.phases]
    lines += ["", "## Attainment vs rate", "", "![attainment vs rate](attainment.png)", "",
              "| label | plan |", "|---|---|", *[f"| {label} | {full} |" for label, full in names.items()], ""]
    for label, pts in curves.items():
        lines.append(f"- {label}: " + ", ".join(f"{r:.2f} req/s -> {a:.1%}" for r, a in pts))
    if res.rejected:
        lines += ["", "## Configurations rejected", "", *[f"- {r}" for r in res.rejected[:20]]]
    lines += ["", "Predictions come from a discrete-event simulation over the latency model; they are not "
                  "measurements. Validate with `pdserve bench` on the written spec.", ""]
    return "\n".join(lines)


def _plan_dict(p: Plan | None) -> dict | None:
    if p is None:
        return None
    return {"mode": p.mode, "placement": p.placement, "gpus": p.gpus, "goodput": p.goodput,
            "per_gpu_goodput": p.per_gpu_goodput, "ideal_per_gpu_goodput": p.ideal_per_gpu_goodput,
            "attainment": p.attainment, "percentiles_s": p.result.percentiles() if p.result else None,
            "pools": [{"phase": c.phase, "replicas": n, "tp": c.parallel.tp, "pp": c.parallel.pp,
                       **({"ep": c.parallel.ep} if c.parallel.ep > 1 else {}),
                       "token_budget": c.token_budget, "goodput": c.goodput, "binding": c.binding}
                      for c, n in p.pools]}


def _summary(req: PlanRequest, res: SearchResult, inputs: dict, best_d, best_c, whole: dict) -> dict:
    return {"inputs": inputs, "chosen": _plan_dict(res.best), "best_disaggregated": _plan_dict(best_d),
            "best_colocated": _plan_dict(best_c), "whole_plan_goodput": whole,
            "whole_plan_goodput_per_gpu": {m: g / p.gpus for m, g in whole.items()
                                           for p in (best_d, best_c) if p is not None and p.mode == m},
            "binding": binding_constraint(req, res.best, whole.get(res.best.mode)), "why": why(best_d, best_c, whole), "search_seconds": res.seconds}
