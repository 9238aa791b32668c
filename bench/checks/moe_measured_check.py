"""The planner's MoE decode step against public measured fused-MoE kernel times (issue 35), offline.

    python bench/checks/moe_measured_check.py                 # tables in data/gpu_profiles/moe
    python bench/checks/moe_measured_check.py --no-route      # the model before its routing-kernel term

Prints, per measured row, the planner's routed-experts time of one MoE layer beside vLLM's published fused-MoE
kernel time (ratio = planner / measured), decode steps composed from those measured layers beside the
planner's own step, and served Qwen3-30B-A3B steps (mean TPOT) beside the planner's. What is composed and
why: cluster/planner/calibrate/moe_check.py; the sources: data/gpu_profiles/moe/README.md. Bands (what the
data show, tests/unit/test_planner_moe_measured.py): bf16 kernels 0.85-1.12, composed bf16 decode steps
0.9-1.1; fp8 and the served steps are reported, not banded here. Exit 0 when both bands hold.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain script folder: make `cluster` importable without an install
    sys.path.insert(0, str(ROOT))

from cluster.planner.calibrate import moe_check  # noqa: E402
from cluster.planner.latency import moe  # noqa: E402

KERNEL_BAND, STEP_BAND = (0.85, 1.12), (0.9, 1.1)


def _line(name: str, ratios: list[float]) -> str:
    median, low, high = moe_check.spread(ratios)
    return f"{name}: {len(ratios)} points, median {median:.2f}, range {low:.2f}-{high:.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tables", type=Path, default=moe_check.DEFAULT_DIR, help="default: data/gpu_profiles/moe")
    ap.add_argument("--context", type=int, default=moe_check.STEP_CONTEXT, help="context per sequence (tokens) "
                    "of the composed decode steps")
    ap.add_argument("--no-route", action="store_true", help="price no routing kernels (the model before them)")
    args = ap.parse_args(argv)
    if args.no_route:
        moe.ROUTE_KERNELS = 0
    rows = moe_check.load_kernel_rows(args.tables / moe_check.KERNELS)
    kernels = moe_check.kernel_points(rows)
    steps = moe_check.step_points(rows, args.context)
    served = moe_check.serving_points(moe_check.load_serving_rows(args.tables / moe_check.SERVING))
    print("## One MoE layer's routed experts (fused-MoE kernel), planner vs measured\n")
    print(moe_check.kernel_table(kernels))
    print(f"\n## Decode steps composed from the measured MoE layers (bf16, batch <= {moe_check.DECODE_MAX}, "
          f"{args.context} tokens of context a sequence)\n")
    print(moe_check.step_table(steps))
    print("\n## Served decode steps (mean TPOT)\n")
    print(moe_check.serving_table(served))
    print("\n## Summary\n")
    bf16 = [p.ratio for p in kernels if p.row.dtype == "bfloat16"]
    for source in dict.fromkeys(p.row.source for p in kernels):
        print(_line(f"kernels {source}", [p.ratio for p in kernels if p.row.source == source]))
    print(_line("kernels bf16, all", bf16))
    print(_line("composed decode steps", [p.ratio for p in steps]))
    for p in served:
        print(f"served step {p.row.source} (concurrency {p.row.concurrency}, {p.row.input_len:.0f} in): ratio {p.ratio:.2f}")
    ok = (all(KERNEL_BAND[0] <= r <= KERNEL_BAND[1] for r in bf16)
          and all(STEP_BAND[0] <= p.ratio <= STEP_BAND[1] for p in steps))
    print(f"\nbands (bf16 kernels {KERNEL_BAND[0]}-{KERNEL_BAND[1]}, composed steps {STEP_BAND[0]}-{STEP_BAND[1]}): "
          f"{'met' if ok else 'NOT met'}" + (" (routing kernels off)" if args.no_route else ""))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
