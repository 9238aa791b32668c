"""What `pdserve plan` was asked, as a `PlanRequest` (shared by `plan_cmd` and `designs_cmd`).

    build_request(args) -> (PlanRequest, inputs)   the model, hardware, profile, workload lengths and SLO;
                                                   `inputs`: the command line, workload and latency model
                                                   as the spec header and the report name them
    wants_designs(args)                            several types, an objective or a budget: the design search

Measured GPU tables given as --profile are fitted here, on the spot (`calibrate.gpu_fit`, numpy, imported
only then). Errors are `PlannerError`s naming the flag.
"""
from __future__ import annotations

import argparse
import shlex
import sys

from cluster.planner.errors import PlannerError
from cluster.planner.inputs.hardware import Hardware, load_hardware
from cluster.planner.inputs.models import load_model
from cluster.planner.inputs.workload import clamp, distribution_lengths, scale_lengths, subsample, trace_lengths
from cluster.planner.latency.profiles import Profile, describe_latency, is_table_profile, load_profile
from cluster.planner.search.request import PlanRequest
from cluster.planner.sim.metrics import SLO


def _profile(args: argparse.Namespace, hw: Hardware) -> Profile:
    """--profile: a profile JSON (a path or a name under deploy/profiles/), or measured tables for `hw`."""
    if is_table_profile(args.profile):
        from cluster.planner.calibrate.gpu_fit import table_profile  # numpy: only when tables are given
        return table_profile(args.profile, hw)
    return load_profile(args.profile, args.corun, args.serving == "on")


def build_request(args: argparse.Namespace) -> tuple[PlanRequest, dict]:
    model = load_model(args.model)
    hw = load_hardware(args.hardware, args.inter_node_gbs)
    profile = _profile(args, hw) if args.profile else None
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
    sample = tuple(clamp(subsample(pairs, seed=args.seed), max_len))
    req = PlanRequest(model, hw, args.nodes, args.gpus_per_node, sample, args.rate,
                      SLO(args.ttft_ms / 1000, args.tpot_ms / 1000, args.attainment), args.dtype, profile,
                      max_len, seed=args.seed)
    latency = describe_latency(profile, hw, args.corun)
    return req, {"command": "pdserve " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
                 "workload": workload, "latency": latency}


def wants_designs(args: argparse.Namespace) -> bool:
    """Several hardware types, an objective or a budget: the design search (`designs_cmd`)."""
    return "," in args.hardware or any(getattr(args, k, None) is not None for k in
                                       ("objective", "budget_cost", "budget_power", "price", "power"))
