"""The design comparison report: `DIR/report.md`, `DIR/designs.png`, `DIR/designs.json`.

Reads a `search.designs.DesignResult`: every family's best design (D1, D2, ... in the plot; the full names in the
table beside it), its cost per hour, power and goodput, the Pareto front over (goodput max, cost min,
power min) and the homogeneous baselines; says in one sentence why the winner wins (`why_winner`: per
phase, which machine type serves the most per dollar, watt or GPU). The plot's goodput is each design's
whole plan simulated (`probe.PlanProbe`; in budget mode the search measured it already).
matplotlib (Agg) is imported here only. Who calls: `commands/designs_cmd`, bench/repro/splitwise/repro.py
(`design_table`).
"""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Callable

from cluster.planner.inputs.hardware import Hardware
from cluster.planner.search.cost import pool_watts
from cluster.planner.search.designs import Design, DesignResult
from cluster.planner.search.pareto import pareto_front
from cluster.planner.search.plans import PhaseChoice
from cluster.planner.search.probe import PlanProbe

UNITS = {"cost": "$/h", "goodput-per-dollar": "$/h", "power": "kW", "gpus": "GPU"}


def front(designs: tuple[Design, ...] | list[Design]) -> set[str]:
    """Labels of the designs on the Pareto front (most goodput, least cost, least power)."""
    pts = [(d.goodput, d.cost, d.power) for d in designs]
    if any(p[1] is None or p[2] is None for p in pts):  # no prices or power: goodput per GPU instead
        pts = [(d.goodput / d.plan.gpus,) for d in designs]
        return {designs[k].label for k in pareto_front(pts, ("max",))}
    return {designs[k].label for k in pareto_front(pts, ("max", "min", "min"))}


def _unit_price(objective: str, phase: str, hw: Hardware) -> float | None:
    """What one device of `hw` counts for the objective (1 GPU, its $/h, its kW in `phase`)."""
    if objective == "power":
        w = pool_watts(hw, phase)
        return w / 1000 if w else None
    if objective in ("cost", "goodput-per-dollar"):
        return hw.price_per_hour
    return 1.0


def _pool_for(res: DesignResult, hw_of, phase: str, kind: str, rate: float) -> tuple[float, str] | None:
    """The least a pool of `phase` on `kind` spends (objective units) to serve `rate`: replicas of the
    instance kind that needs the least for it."""
    best = None
    for c in res.phases:
        unit = _unit_price(res.objective, phase, hw_of(c.hardware))
        if c.phase != phase or c.hardware != kind or unit is None:
            continue
        n = math.ceil(rate / c.goodput - 1e-9)
        value = n * c.parallel.gpus * unit
        if best is None or value < best[0]:
            best = (value, f"{n} x {c.parallel}")
    return best


def why_winner(res: DesignResult, hw_of: Callable[[str], Hardware]) -> str:
    """One sentence: the winner against the best homogeneous design, and per pool of the winner what the
    same pool would spend on each other machine type for the same rate (from per-instance goodputs)."""
    best = res.best
    base = next((d for d in res.designs if d.homogeneous and d is not best), None)
    if res.budget is not None:
        head = f"{best.label} ({best.family}) serves the most within {res.budget.describe(res.budget.limit)}: " \
               f"{best.goodput:.2f} req/s"
        head += f" vs {base.goodput:.2f} for the best homogeneous design {base.label} ({base.family})" if base else ""
        if base and best.goodput <= base.goodput * 1.02:  # a tie on goodput: the spend decided
            spent = (lambda d: d.cost) if res.budget.kind == "cost" else (lambda d: d.power)
            head += f", spending {res.budget.describe(spent(best))} vs {res.budget.describe(spent(base))}"
        rate = best.goodput
    else:
        head = f"{best.label} ({best.family}) needs {_value(best, res.objective)} for the target rate"
        head += (f" vs {_value(base, res.objective)} for the best homogeneous design {base.label} ({base.family})"
                 if base else "")
        rate = min(c.goodput * n for c, n in best.plan.pools)
    kinds = sorted({c.hardware for c in res.phases})
    fmt = {"cost": "${:,.2f}/h", "goodput-per-dollar": "${:,.2f}/h", "power": "{:,.2f} kW", "gpus": "{:g} GPUs"}
    parts = []
    for c, _ in best.plan.pools:
        options = {k: _pool_for(res, hw_of, c.phase, k, rate) for k in kinds}
        shown = [f"{fmt[res.objective].format(v[0])} on {k} ({v[1]})" for k, v in options.items() if v]
        if len(shown) > 1:
            parts.append(f"a {c.phase} pool for {rate:.3g} req/s needs " + " vs ".join(shown))
    return f"{head}; " + "; ".join(parts) + "." if parts else f"{head}."


def _value(d: Design, objective: str) -> str:
    if objective in ("cost",):
        return f"${d.cost:,.2f}/h"
    if objective == "power":
        return f"{d.power / 1000:,.2f} kW"
    if objective == "goodput-per-dollar":
        return f"{d.per_dollar:.3f} req/s per $/h"
    return f"{d.plan.gpus} GPUs"


def design_table(designs, on_front: set[str]) -> list[str]:
    rows = ["| label | design | family | GPUs | cost ($/h) | power (kW) | goodput (req/s) | req/s per $/h | "
            "Pareto | baseline |", "|---|---|---|---|---|---|---|---|---|---|"]
    for d in designs:
        cost = f"{d.cost:,.2f}" if d.cost is not None else "-"
        power = f"{d.power / 1000:,.2f}" if d.power is not None else "-"
        pd = f"{d.per_dollar:.3f}" if d.per_dollar is not None else "-"
        rows.append(f"| {d.label} | {d.name} | {d.family} | {d.plan.gpus} | {cost} | {power} | {d.goodput:.2f} | "
                    f"{pd} | {'yes' if d.label in on_front else ''} | {'yes' if d.homogeneous else ''} |")
    return rows


def plot_designs(path: Path, designs, on_front: set[str], title: str) -> list[str]:
    """Goodput against cost/hour and against power; short labels at the points, homogeneous baselines as
    squares, the Pareto front ringed; a short key (label: family) beside the panels. Returns the labels
    drawn at the points."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("cost", "cost ($/h)", lambda d: d.cost), ("power", "power (kW)",
                                                         lambda d: d.power / 1000 if d.power else None)]
    panels = [p for p in panels if all(p[2](d) is not None for d in designs)] or \
        [("gpus", "GPUs", lambda d: d.plan.gpus)]
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(4.2 * len(panels) + 3.2, 3.8),
                             gridspec_kw={"width_ratios": [4] * len(panels) + [3]})
    for ax, (_, xlabel, x) in zip(axes, panels):
        for d in designs:
            ax.scatter(x(d), d.goodput, marker="s" if d.homogeneous else "o",
                       color="tab:grey" if d.homogeneous else "tab:blue", zorder=3)
            if d.label in on_front:
                ax.scatter(x(d), d.goodput, s=160, facecolors="none", edgecolors="tab:red", zorder=4)
            ax.annotate(d.label, (x(d), d.goodput), textcoords="offset points", xytext=(5, 4), fontsize=8)
        ax.margins(0.15)  # room for the labels at the edges
        ax.set_xlabel(xlabel)
        ax.set_ylabel("goodput (req/s)")
        ax.grid(alpha=0.3)
    key = axes[-1]
    key.axis("off")
    lines = [f"{d.label}: {d.family}" + (" *" if d.label in on_front else "") for d in designs]
    key.text(0, 1, "\n".join(lines + ["", "square: one type", "ring / *: Pareto front"]), va="top",
             fontsize=8, family="monospace", transform=key.transAxes)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    drawn = [t.get_text() for ax in axes[:-1] for t in ax.texts]
    plt.close(fig)
    return drawn


def whole_plan_goodputs(req, res: DesignResult) -> DesignResult:
    """Rate mode: each design's goodput from its whole plan simulated (budget mode: already so)."""
    if res.budget is not None:
        return res
    designs = tuple(replace(d, goodput=PlanProbe(req, d.plan).goodput()) for d in res.designs)
    return replace(res, designs=designs, best=designs[0])


def write_design_report(out_dir: str | Path, req, res: DesignResult, inputs: dict, spec_path: str) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    res = whole_plan_goodputs(req, res)
    on_front = front(res.designs)
    title = (f"{req.model.name}: TTFT {req.slo.ttft_s * 1000:g} ms, TPOT {req.slo.tpot_s * 1000:g} ms, "
             f"{req.slo.attainment:.0%}")
    plot_designs(out / "designs.png", res.designs, on_front, title)
    goal = (f"the most goodput within {res.budget.flag} {res.budget.limit:g}" if res.budget else
            f"{req.rate:g} req/s, objective {res.objective}")
    md = [f"# pdserve plan: designs for {req.model.name} on {', '.join(h.name for h in req.types)}", "",
          f"- command: `{inputs['command']}`", f"- workload: {inputs['workload']}", f"- goal: {goal}",
          f"- SLO: TTFT <= {req.slo.ttft_s * 1000:g} ms and TPOT <= {req.slo.tpot_s * 1000:g} ms for "
          f"{req.slo.attainment:.0%} of requests; {req.nodes} x {req.gpus_per_node} devices per type",
          f"- search: {res.seconds:.1f} s", "", f"## Winner: {res.best.label} -> `{spec_path}`", "",
          f"**{res.best.name}**", "", f"Why: {why_winner(res, req.hw_of)}", "", "## Designs", "",
          "![goodput vs cost and power](designs.png)", "", *design_table(res.designs, on_front), "",
          "Goodput: the whole plan simulated at rising rates (the highest meeting the SLO attainment). "
          "Baselines: designs on one machine type. Pareto: no other design has more goodput at no more cost "
          "and power.", ""]
    (out / "report.md").write_text("\n".join(md))
    (out / "designs.json").write_text(json.dumps(
        {"inputs": inputs, "objective": res.objective, "winner": res.best.label, "why": why_winner(res, req.hw_of),
         "designs": [{"label": d.label, "name": d.name, "family": d.family, "gpus": d.plan.gpus, "cost": d.cost,
                      "power_w": d.power, "goodput": d.goodput, "pareto": d.label in on_front,
                      "homogeneous": d.homogeneous} for d in res.designs]}, indent=2))
    return out / "report.md"
