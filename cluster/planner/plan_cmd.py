"""`pdserve plan`: arguments -> `search.PlanRequest` -> search -> spec (`spec_writer`) + report (`report`).

Prints the chosen plan, the best plan of the other mode and where it wrote things; every planner error
(unknown model or hardware, no configuration fits, impossible SLO or rate) prints `error: ...` and exits 2.
"""
from __future__ import annotations

import argparse
import shlex
import sys
import time

from cluster.planner.errors import PlannerError
from cluster.planner.hardware import load_hardware
from cluster.planner.metrics import SLO
from cluster.planner.models import load_model
from cluster.planner.profiles import describe_latency, load_profile
from cluster.planner.search import PlanRequest, SearchResult, search
from cluster.planner.workload import clamp, distribution_lengths, scale_lengths, subsample, trace_lengths


def build_request(args: argparse.Namespace) -> tuple[PlanRequest, dict]:
    model = load_model(args.model)
    hw = load_hardware(args.hardware, args.inter_node_gbs)
    profile = load_profile(args.profile, args.corun, args.serving == "on", hw) if args.profile else None
    for name, v in (("--nodes", args.nodes), ("--gpus-per-node", args.gpus_per_node)):
        if v < 1:
            raise PlannerError(f"{name} must be >= 1 (got {v})")
    if args.rate is None:
        raise PlannerError("--rate: give the request rate (req/s) the plan must sustain, or --budget-cost / "
                           "--budget-power for the most goodput within a budget")
    if args.rate <= 0 or args.ttft_ms <= 0 or args.tpot_ms <= 0 or not 0 < args.attainment <= 1:
        raise PlannerError("--rate, --ttft-ms and --tpot-ms must be > 0 and --attainment in (0, 1]")
    if args.workload:
        pairs, workload = trace_lengths(args.workload), args.workload
        scaling = (args.input_scale, args.output_scale, args.max_input, args.max_output)
        if scaling != (1.0, 1.0, None, None):  # the lengths `pdserve bench` sends with the same options
            pairs = scale_lengths(pairs, *scaling)
            workload += (f" (lengths x{args.input_scale:g} in, x{args.output_scale:g} out, capped at "
                         f"{args.max_input or '-'} / {args.max_output or '-'})")
    else:
        if not args.output_len:
            raise PlannerError("--input-len needs --output-len (or give --workload TRACE)")
        pairs = distribution_lengths(args.input_len, args.output_len, seed=args.seed)
        workload = f"input {args.input_len}, output {args.output_len}"
    max_len = args.max_len or min(model.max_positions, 32768)
    req = PlanRequest(model, hw, args.nodes, args.gpus_per_node, tuple(clamp(subsample(pairs, seed=args.seed), max_len)), args.rate,
                      SLO(args.ttft_ms / 1000, args.tpot_ms / 1000, args.attainment), args.dtype, profile,
                      max_len, seed=args.seed)
    latency = describe_latency(profile, hw, args.corun)
    return req, {"command": "pdserve " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
                 "workload": workload, "latency": latency}


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


def wants_designs(args: argparse.Namespace) -> bool:
    """Several hardware types, an objective or a budget: the design search (`hetero_cmd`)."""
    return "," in args.hardware or any(getattr(args, k, None) is not None for k in
                                       ("objective", "budget_cost", "budget_power", "price", "power"))


def run_plan(args: argparse.Namespace) -> int:
    from cluster.planner.spec_writer import model_notes, plan_spec, spec_model, write_spec

    if wants_designs(args):
        from cluster.planner.hetero_cmd import run_designs
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
              f"latency model: {inputs['latency']}"] + model_notes(req.model)
    if req.nodes > 1 and res.best.mode == "disaggregated":
        header.append(f"KV receivers listen beyond loopback: export {'PDSERVE_KV_TOKEN'} on every node")
    write_spec(spec, args.out, header)
    report, summary = None, {}
    if args.report:
        from cluster.planner.report import write_report
        path, summary = write_report(args.report, req, res, inputs, args.out)
        report = str(path)
    _print(res, args.out, report)
    for note in model_notes(req.model):
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
