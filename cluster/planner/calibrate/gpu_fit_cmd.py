"""`pdserve fit-gpu TABLES... --hardware NAME`: fit the GPU step model's constants to measured tables.

    pdserve fit-gpu data/gpu_profiles/vidur/a100_meta-llama_Meta-Llama-3-8B_mlp.csv \\
        data/gpu_profiles/vidur/a100_dgx_all_reduce.csv --hardware a100 --out deploy/profiles/my-a100.json

Reads Vidur-layout tables (`vidur_tables`: compute, attention, all-reduce; files or directories of one
GPU kind), fits them (`gpu_fit`: groups the tables lack keep the hardware entry's constants), prints each
group's fit error and the `step:` block for deploy/hardware.yaml, and with `--out` writes a profile JSON
that `pdserve plan --profile` reads (the tables themselves are accepted there too: fitted on the spot).
Bad tables print `error: FILE: row R, column C: ...` and exit 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from cluster.planner.calibrate.gpu_fit import fit_constants
from cluster.planner.calibrate.vidur_tables import load_tables
from cluster.planner.errors import PlannerError
from cluster.planner.inputs.gpu_constants import entry_dict
from cluster.planner.inputs.hardware import load_hardware


def _errors_line(name: str, e: dict) -> str:
    if not e.get("points"):
        return f"  {name}: no rows"
    return f"  {name}: {e['points']} rows, mean error {100 * e['mean_rel_err']:.1f}%, worst {100 * e['max_rel_err']:.0f}%"


def run_fit_gpu(args: argparse.Namespace) -> int:
    try:
        hw = load_hardware(args.hardware)
        if hw.step is None:
            raise PlannerError(f"hardware {hw.name} has no `step:` block in deploy/hardware.yaml to start from "
                               f"(a GPU entry is needed)")
        tables = load_tables(args.tables)
        step, report = fit_constants(tables, hw, hw.step)
    except PlannerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"fitted on {hw.name}: {', '.join(report['fitted'])}; kept from deploy/hardware.yaml: "
          f"{', '.join(report['kept'])}")
    for group in ("gemm", "attention"):
        for name, e in ([(group, report[group])] if group == "gemm" and group in report else
                        report.get(group, {}).items()):
            print(_errors_line(name if group == "gemm" else f"{group} {name}", e))
    for name, e in report.get("small_ops", {}).items():
        print(_errors_line(f"small op {name}", e))
    for n, e in report.get("allreduce", {}).items():
        print(_errors_line(f"all-reduce {n} GPUs", e))
    block = entry_dict(step)
    print("\nstep: block for deploy/hardware.yaml:\n" + yaml.safe_dump({"step": block}, sort_keys=False, width=110))
    if args.out:
        out = Path(args.out)
        name = args.name or out.stem
        data = {"name": name, "hardware": hw.name, "step": block, "step_fit": json.loads(json.dumps(report, default=str)),
                "notes": f"pdserve fit-gpu {' '.join(args.tables)} --hardware {args.hardware}"}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=1) + "\n")
        print(f"profile -> {out} (pdserve plan --hardware {args.hardware} --profile {out} ...)")
    return 0
