"""Measured CUDA step times and power (bench/gpu/step_power.py's JSON) beside the planner's tables.

For each measured case: the engine's median step time against the planner's GPU step model for the same
step on the same hardware entry (`profiles.latency_model`, TP 1: a prefill of N tokens; a decode step of
B rows at the mean context the timed steps saw), and the GPU's mean power (nvidia-smi power.draw, the
driver's 1 s average, over the case's steady part) against `deploy/hardware.yaml`'s prefill_w / decode_w.
Pure Python on any machine: the measuring was done on the GPU.

Run:  .venv/bin/python bench/gpu/step_compare.py bench/gpu_results/h100-2026-11-26/after/steps_*.json
      [--hardware h100] [--model-name random:llama-3-8b=llama-3-8b ...]
Prints a markdown table (and writes it with --out FILE).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cluster.planner.inputs.hardware import load_hardware  # noqa: E402
from cluster.planner.inputs.models import load_model  # noqa: E402
from cluster.planner.latency.base import Parallel  # noqa: E402
from cluster.planner.latency.profiles import latency_model  # noqa: E402

WARM_STEPS = 3  # decode steps gpu_step_power runs before timing


def planner_model_name(measured: str) -> str:
    """'random:llama-3-8b' -> 'llama-3-8b'; 'smollm2-135m' stays."""
    return measured.split(":", 1)[-1]


def predicted_ms(lat, case: dict, context: int) -> float:
    n = case["size"]
    if case["phase"] == "prefill":
        return lat.stage_prefill(n, n * n) * 1e3
    mean_ctx = context + WARM_STEPS + case["steps"] / 2  # each row grows one slot per step
    return lat.stage_mixed(0.0, 0.0, n, n * mean_ctx) * 1e3


def rows_for(result: dict, hw_name: str) -> list[dict]:
    hw = load_hardware(hw_name)
    model = load_model(planner_model_name(result["model"]))
    lat = latency_model(model, hw, Parallel(1, 1))
    out = []
    for case in result["cases"]:
        pred = predicted_ms(lat, case, result["context"])
        table_w = hw.prefill_w if case["phase"] == "prefill" else hw.decode_w
        watts = (case.get("power") or {}).get("power.draw")
        out.append({"model": result["model"], "phase": case["phase"], "size": case["size"],
                    "measured_ms": case["median_ms"], "planner_ms": round(pred, 3),
                    "time_ratio": round(case["median_ms"] / pred, 2),
                    "measured_w": watts, "table_w": table_w,
                    "power_ratio": round(watts / table_w, 2) if watts and table_w else None,
                    "util": (case.get("power") or {}).get("utilization.gpu")})
    return out


def markdown(rows: list[dict], idle: dict[str, float | None]) -> str:
    head = ("| model | phase | size (tokens / rows) | engine ms | planner ms | engine / planner | W measured | "
            "W table | measured / table | GPU util % |\n|---|---|---|---|---|---|---|---|---|---|\n")
    body = "".join(f"| {r['model']} | {r['phase']} | {r['size']} | {r['measured_ms']} | {r['planner_ms']} | "
                   f"{r['time_ratio']} | {r['measured_w']} | {r['table_w']} | {r['power_ratio']} | {r['util']} |\n"
                   for r in rows)
    idle_line = "; ".join(f"{m}: {w} W" for m, w in idle.items())
    return head + body + f"\nIdle power before each run (power.draw): {idle_line}\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    rows, idle = [], {}
    for path in a.results:
        result = json.loads(path.read_text())
        rows += rows_for(result, a.hardware)
        idle[result["model"]] = (result.get("idle") or {}).get("power.draw")
    text = markdown(rows, idle)
    print(text)
    if a.out:
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
