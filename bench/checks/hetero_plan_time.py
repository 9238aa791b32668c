"""How long the design search takes for 32 GPUs across two machine types (issue 26: < 60 s).

    python bench/checks/hetero_plan_time.py                          # llama-2-70b, h100 + a100, 2 x 8 each
    python bench/checks/hetero_plan_time.py --model llama-3-8b --hardware h100,l40s --objective power

Runs `hetero.plan_designs` (every pairing, colocated per type, whole-plan checks) on the Azure conversation
trace at a rate the smaller type can serve, and prints the search's wall-clock seconds next to the winner.
A bench, not a test: a shared machine's load moves the figure; quote it with the machine's state.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cluster.planner.inputs.hardware import load_hardware  # noqa: E402
from cluster.planner.inputs.models import load_model  # noqa: E402
from cluster.planner.inputs.workload import clamp, subsample, trace_lengths  # noqa: E402
from cluster.planner.search.cost import parse_hardware_list  # noqa: E402
from cluster.planner.search.designs import plan_designs  # noqa: E402
from cluster.planner.search.request import PlanRequest  # noqa: E402
from cluster.planner.sim.metrics import SLO  # noqa: E402

TRACE = Path(__file__).resolve().parents[2] / "data" / "workloads" / "azure_llm_2023_conv.csv"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-2-70b")
    ap.add_argument("--hardware", default="h100,a100")
    ap.add_argument("--nodes", type=int, default=2, help="nodes per type")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--rate", type=float, default=10.0)
    ap.add_argument("--objective", default="cost")
    args = ap.parse_args(argv)
    model = load_model(args.model)
    hws = [load_hardware(n) for n in parse_hardware_list(args.hardware)]
    max_len = min(model.max_positions, 8192)
    pairs = tuple(clamp(subsample(trace_lengths(TRACE), seed=0), max_len))
    req = PlanRequest(model, hws[0], args.nodes, args.gpus_per_node, pairs, args.rate, SLO(2.0, 0.1, 0.9),
                      max_len=max_len)
    start = time.perf_counter()
    res = plan_designs(req, hws, args.objective)
    took = time.perf_counter() - start
    gpus = args.nodes * args.gpus_per_node * len(hws)
    print(f"{args.model} on {gpus} GPUs ({args.nodes} x {args.gpus_per_node} per type of {args.hardware}), "
          f"{args.rate:g} req/s, objective {args.objective}: {len(res.designs)} designs in {took:.1f} s "
          f"(limit 60 s); winner {res.best.label}: {res.best.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
