"""`pdserve plan` over designs: several `--hardware` types, an `--objective` or a `--budget-*`.

    pdserve plan --model llama-2-70b --hardware h100,a100 --objective cost --workload TRACE --rate 20 \\
        --ttft-ms 2000 --tpot-ms 100 --nodes 2 --out cluster.yaml --report designs/

Order: names and overrides (`cost.parse_*`, typed errors naming the flag) -> the numbers the objective or
budget needs (`cost.require`) -> `plan_inputs.build_request` for the first type (workload, SLO, model) ->
`search.designs.plan_designs` -> the winner's spec (each pool asks for its type's Ray `accelerator_type`) ->
the table on the terminal and, with --report, `design_report`. Errors print `error: ...` and exit 2.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

from cluster.planner.commands.plan_inputs import build_request
from cluster.planner.errors import PlannerError
from cluster.planner.inputs.hardware import load_hardware
from cluster.planner.search.cost import parse_hardware_list, parse_overrides, require, with_overrides
from cluster.planner.search.designs import Budget, DesignResult, plan_designs


def _inputs(args: argparse.Namespace):
    names = parse_hardware_list(args.hardware)
    prices = parse_overrides("--price", args.price, "USD per device-hour")
    powers = parse_overrides("--power", args.power, "W per device")
    hws = [with_overrides(load_hardware(n, args.inter_node_gbs), prices, powers) for n in names]
    if args.profile and len(hws) > 1:
        raise PlannerError("--profile holds one hardware type's latencies; with several --hardware types each is "
                           "planned with its own GPU step model (drop --profile, or plan one type)")
    budget = (Budget("cost", args.budget_cost) if args.budget_cost is not None else
              Budget("power", args.budget_power) if args.budget_power is not None else None)
    objective = args.objective or (budget.kind if budget else "gpus")
    require(hws, objective, args.budget_cost, args.budget_power)
    return hws, budget, objective


def _print(res: DesignResult, out: str, report: str | None) -> None:
    for d in res.designs:
        cost = f"${d.cost:,.2f}/h" if d.cost is not None else "no price"
        power = f"{d.power / 1000:,.2f} kW" if d.power is not None else "no power"
        mark = "*" if d is res.best else " "
        print(f" {mark}{d.label}: {d.name}: {cost}, {power}, goodput {d.goodput:.2f} req/s")
    print(f"  search {res.seconds:.1f} s; spec -> {out}" + (f"; report -> {report}" if report else ""))


def run_designs(args: argparse.Namespace) -> int:
    from cluster.planner.emit.spec_writer import model_notes, plan_spec, spec_model, write_spec

    start = time.perf_counter()
    try:
        hws, budget, objective = _inputs(args)
        one = argparse.Namespace(**{**vars(args), "hardware": hws[0].name,
                                    "rate": args.rate if args.rate is not None or budget is None else 1.0})
        req, inputs = build_request(one)
        req = replace(req, hw=hws[0], types=tuple(hws))
        model_name = spec_model(args.spec_model, req.model)
        res = plan_designs(req, hws, objective, budget)
    except PlannerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    best = res.best.plan
    kinds = {c.hardware for c, _ in best.pools}
    nodes = req.nodes * len(kinds)  # each machine type on its own nodes
    spec = plan_spec(best, model_name, req.dtype, nodes, req.hw_of(best.pools[0][0].hardware).is_cpu, req.model_len,
                     args.ttft_ms, args.tpot_ms, {c.phase: req.hw_of(c.hardware).accelerator_type for c, _ in best.pools})
    goal = f"most goodput within {budget.flag} {budget.limit:g}" if budget else f"objective {objective}"
    header = [f"written by `{inputs['command']}`", f"design {res.best.label} ({goal}): {res.best.name}",
              f"latency model: each type's GPU step model (deploy/hardware.yaml)"] + model_notes(req.model)
    write_spec(spec, args.out, header)
    report = None
    if args.report:
        from cluster.planner.emit.design_report import write_design_report
        report = str(write_design_report(args.report, req, res, inputs, args.out))
    print(f"plan: {res.best.label}: {res.best.name} ({goal})")
    _print(res, args.out, report)
    from cluster.planner.emit.design_report import why_winner
    print(f"  why: {why_winner(res, req.hw_of)}")
    print(f"  total {time.perf_counter() - start:.1f} s")
    return 0
