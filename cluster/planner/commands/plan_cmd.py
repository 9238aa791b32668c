"""`pdserve plan`: arguments -> `PlanRequest` (`plan_inputs`) -> search -> spec (`emit/spec_writer`) + report
(`emit/report`). Several hardware types, an objective or a budget: the design search (`designs_cmd`).

Prints the chosen plan, the best plan of the other mode and where it wrote things; every planner error
(unknown model or hardware, no configuration fits, impossible SLO or rate) prints `error: ...` and exits 2.
"""
from __future__ import annotations

import argparse
import sys
import time

from cluster.planner.commands.plan_inputs import build_request, wants_designs
from cluster.planner.errors import PlannerError
from cluster.planner.search.plan_search import SearchResult, search


def _print(res: SearchResult, out: str, report: str | None) -> None:
    b = res.best
    print(f"plan: {b.describe()}")
    print(f"  predicted goodput {b.goodput:.2f} req/s ({b.per_gpu_goodput:.2f} per GPU, "
          f"{b.ideal_per_gpu_goodput:.2f} at the ideal ratio); attainment at the target rate "
          f"{b.attainment:.1%}")
    for mode in ("disaggregated", "colocated"):
        p = res.best_of(mode)
        if p is not None:
            print(f"  best {mode}: {p.describe()}: {p.per_gpu_goodput:.2f} req/s per GPU "
                  f"({p.ideal_per_gpu_goodput:.2f} at the ideal ratio)")
    print(f"  search {res.seconds:.1f} s; spec -> {out}" + (f"; report -> {report}" if report else ""))


def run_plan(args: argparse.Namespace) -> int:
    from cluster.planner.emit.spec_writer import layout_notes, model_notes, plan_spec, spec_model, write_spec

    if wants_designs(args):
        from cluster.planner.commands.designs_cmd import run_designs
        return run_designs(args)
    start = time.perf_counter()
    try:
        req, inputs = build_request(args)
        model_name = spec_model(args.spec_model, req.model)  # the spec's `model:` (a Hub id, by default)
        res = search(req)
    except PlannerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    spec = plan_spec(res.best, model_name, req.dtype, req.nodes, req.hw.is_cpu, req.model_len, args.ttft_ms,
                     args.tpot_ms, {c.phase: req.hw.accelerator_type for c, _ in res.best.pools})
    header = [f"written by `{inputs['command']}`",
              f"plan: {res.best.describe()}; predicted goodput {res.best.goodput:.2f} req/s",
              f"latency model: {inputs['latency']}"] + model_notes(req.model) + layout_notes(spec, req.model)
    if req.nodes > 1 and res.best.mode == "disaggregated":
        header.append(f"KV receivers listen beyond loopback: export {'PDSERVE_KV_TOKEN'} on every node")
    write_spec(spec, args.out, header)
    report, summary = None, {}
    if args.report:
        from cluster.planner.emit.report import write_report
        path, summary = write_report(args.report, req, res, inputs, args.out)
        report = str(path)
    _print(res, args.out, report)
    for note in model_notes(req.model) + layout_notes(spec, req.model):
        print(f"  {note}")
    for mode, per_gpu in summary.get("whole_plan_goodput_per_gpu", {}).items():
        print(f"  whole-plan simulated goodput, best {mode}: {summary['whole_plan_goodput'][mode]:.2f} req/s "
              f"= {per_gpu:.2f} per GPU")
    if summary.get("equal_gpus"):
        e = summary["equal_gpus"]
        print(f"  on equal GPUs ({e['gpus']}): colocated x{e['replicas']} {e['colocated']:.2f} req/s vs "
              f"disaggregated {e['disaggregated']:.2f} req/s (whole plans simulated)")
    if summary:
        print(f"  why: {summary['why']}")
    print(f"  total {time.perf_counter() - start:.1f} s")
    return 0
