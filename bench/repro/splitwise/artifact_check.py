"""pdserve's Splitwise simulation beside the paper's own simulator, design point by design point.

    python bench/repro/splitwise/artifact_check.py --sim ~/splitwise-sim --python ~/sws-venv/bin/python \\
        --points BH:40@conv:100,AA:45:25@conv:130 [--seconds 120] [--out bench/results/splitwise_artifact.md]

--sim: a checkout of github.com/Mutinifni/splitwise-sim (MIT; not bundled, not imported: it runs in its own
interpreter, --python, with its requirements: hydra-core, omegaconf, pandas, scipy, networkx, requests).
It is copied to a scratch folder first, where its configs/config.yaml loses the Ray launcher (a sweep
setting; one run needs none) and data/ gets the Azure traces of data/workloads.
A point is DESIGN[:P[:T]]@TRACE:RATE. DESIGN: BA, BH (baselines: P machines, default 70 and 40), AA, HH,
HA, HC (Splitwise-AA/-HH/-HA/-HHcap: P prompt and T token machines). Per point: the artifact's
generate_trace.py draws a Poisson trace (seed 0) of --seconds; its run.py serves it (its scripts/
overrides; BLOOM-176B); its per-request results are read the way its notebooks read them (slowdowns
against the request alone on a DGX-A100, notebooks/plots.ipynb) -- and `verify.artifact_run`
runs the same point in pdserve's simulator. The table gives each side's nine percentiles and its worst
percentile / bound (< 1: every bound met).
"""
from __future__ import annotations

import argparse
import csv
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from bench.repro.splitwise.designs import WORKLOADS  # noqa: E402
from bench.repro.splitwise.slo import SPLITWISE_BOUNDS  # noqa: E402
from bench.repro.splitwise.step_table import StepTable  # noqa: E402
from bench.repro.splitwise.verify import artifact_run  # noqa: E402
from cluster.planner.inputs.models import load_model  # noqa: E402
from cluster.planner.inputs.workload import trace_lengths  # noqa: E402

NAMES = {"BA": "Baseline-A100", "BH": "Baseline-H100", "AA": "Splitwise-AA", "HH": "Splitwise-HH",
         "HA": "Splitwise-HA", "HC": "Splitwise-HHcap"}
DEFAULT_N = {"BA": 70, "BH": 40}


def overrides(design: str, a: int, b: int) -> list[str]:
    """The artifact's run.py overrides for a design (its scripts/run_*.sh)."""
    split = ["applications.0.scheduler=mixed_pool", f"start_state.prompt.num_instances={a}",
             f"start_state.token.num_instances={b}"]
    return {
        "BA": ["applications.0.scheduler=token_jsq", "cluster=half_half", f"cluster.servers.0.count={a}",
               "cluster.servers.1.count=0", "start_state=baseline"],
        "BH": ["applications.0.scheduler=token_jsq", "cluster=half_half", "cluster.servers.0.count=0",
               f"cluster.servers.1.count={a}", "start_state=baseline"],
        "AA": split + ["cluster=half_half", f"cluster.servers.0.count={a + b}", "cluster.servers.1.count=0",
                       "start_state=splitwise"],
        "HH": split + ["cluster=half_half", "cluster.servers.0.count=0", f"cluster.servers.1.count={a + b}",
                       "start_state=splitwise", "start_state.token.instance_names=[dgx-h100]"],
        "HA": ["applications.0.scheduler=mixed_pool", "cluster=half_half", f"cluster.servers.0.count={b}",
               f"cluster.servers.1.count={a}", "start_state=splitwise", "start_state.split_type=heterogeneous"],
        "HC": ["applications.0.scheduler=mixed_pool", "cluster=hhcap_half_half", f"cluster.servers.0.count={b}",
               f"cluster.servers.1.count={a}", "start_state=splitwise_hhcap",
               "start_state.split_type=heterogeneous"],
    }[design]


def prepare(sim: Path, work: Path) -> Path:
    """A scratch copy of the artifact that runs one job without Ray, with the Azure traces in data/."""
    if not (work / "run.py").exists():
        shutil.copytree(sim, work, ignore=shutil.ignore_patterns(".git", "results", "traces"))
        cfg = work / "configs" / "config.yaml"
        lines = cfg.read_text().splitlines()
        kept = [ln for ln in lines if "hydra/launcher" not in ln]
        cut = next((k for k, ln in enumerate(kept) if ln.strip() == "launcher:"), len(kept))
        cfg.write_text("\n".join(kept[:cut]) + "\n")
        (work / "traces").mkdir(exist_ok=True)
        for kind in ("code", "conv"):
            shutil.copy(WORKLOADS / f"azure_llm_2023_{kind}.csv", work / "data" / f"{kind}_distributions.csv")
    return work


def artifact_point(work: Path, python: str, design: str, a: int, b: int, trace: str, rate: int,
                   seconds: int) -> Path:
    name = f"rr_{trace}_{rate}_s{seconds}"
    if not (work / "traces" / f"{name}.csv").exists():
        code = ("import numpy as np; np.random.seed(0); from generate_trace import generate_traces; "
                f"generate_traces(1000000, {seconds}, [{rate}], 'data/{trace}_distributions.csv', "
                f"'traces/rr_{trace}_{{}}_s{seconds}.csv')")
        subprocess.run([python, "-c", code], cwd=work, check=True)
    out = work / "out" / f"{design}_{a}_{b}_{name}"
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run([python, "run.py", *overrides(design, a, b), "performance_model=db", f"trace.filename={name}",
                    "seed=0", f"hydra.run.dir={out}"], cwd=work, check=True, capture_output=True)
    return out / "detailed" / "0.csv"


def quantile(values: list[float], q: float) -> float:
    """pandas' default (linear between closest ranks), as the artifact's notebooks compute it."""
    s = sorted(values)
    x = q * (len(s) - 1)
    k = int(x)
    return s[k] + (s[min(k + 1, len(s) - 1)] - s[k]) * (x - k)


def nine(rows: list[tuple[int, int, float, float, float]]) -> tuple[float, list[float]]:
    """rows: (prompt, output tokens, ttft, tbt over all output tokens, e2e) -> (worst / bound, nine values),
    slowdowns against the A100 alone (plots.ipynb: prompt time, and token time at the prompt's tokens)."""
    a100 = StepTable.load("bloom-176b", "splitwise-a100")
    slow = {"ttft": [], "tbt": [], "e2e": []}
    for p, o, ttft, tbt, e2e in rows:
        t1, b1 = a100.prompt(p), a100.token(p)
        slow["ttft"].append(ttft / t1)
        slow["tbt"].append(tbt / b1)
        slow["e2e"].append(e2e / (t1 + b1 * (o - 1)))
    vals = [quantile(slow[m], q / 100) for m, q, _ in SPLITWISE_BOUNDS]
    return max(v / x for v, (_, _, x) in zip(vals, SPLITWISE_BOUNDS)), vals


def artifact_rows(path: Path) -> list[tuple]:
    with path.open() as f:
        return [(int(float(r["prompt_sizes"])), int(float(r["token_sizes"])), float(r["ttft_times"]),
                 float(r["tbt_times"]), float(r["response_times"])) for r in csv.DictReader(f)]


def ours_rows(design: str, a: int, b: int, trace: str, rate: int, seconds: int) -> list[tuple]:
    pairs = trace_lengths(WORKLOADS / f"azure_llm_2023_{trace}.csv")
    res = artifact_run(load_model("bloom-176b"), pairs, NAMES[design], a, b, rate, seconds)
    return [(r.input_len, r.output_len, r.ttft, (r.e2e - r.ttft) / r.output_len, r.e2e) for r in res.results]


def parse(point: str) -> tuple[str, int, int, str, int]:
    head, tail = point.split("@")
    d, *n = head.split(":")
    trace, rate = tail.split(":")
    if d not in NAMES or trace not in ("code", "conv") or (d in DEFAULT_N and len(n) > 1) or \
            (d not in DEFAULT_N and len(n) != 2):
        raise SystemExit(f"bad point {point!r}: DESIGN[:P[:T]]@code|conv:RATE, DESIGN in {sorted(NAMES)}")
    a = int(n[0]) if n else DEFAULT_N[d]
    return d, a, int(n[1]) if len(n) > 1 else 0, trace, int(rate)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sim", type=Path, required=True)
    ap.add_argument("--python", required=True)
    ap.add_argument("--points", required=True)
    ap.add_argument("--seconds", type=int, default=120)
    ap.add_argument("--work", type=Path, default=Path("/tmp/pdserve-splitwise-sim"))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    points = [parse(p) for p in args.points.split(",")]
    work = prepare(args.sim, args.work)
    head = " | ".join(f"{m} P{q} (<= {x:g})" for m, q, x in SPLITWISE_BOUNDS)
    lines = [f"| point | side | worst / bound | {head} | s |",
             "|---|---|---|" + "---|" * len(SPLITWISE_BOUNDS) + "---|"]
    for d, a, b, trace, rate in points:
        label = f"{NAMES[d]} {a}{f'P+{b}T' if b else ''} {trace}@{rate}"
        for side in ("artifact", "pdserve"):
            t0 = time.perf_counter()
            rows = (artifact_rows(artifact_point(work, args.python, d, a, b, trace, rate, args.seconds))
                    if side == "artifact" else ours_rows(d, a, b, trace, rate, args.seconds))
            worst, vals = nine(rows)
            lines.append(f"| {label} | {side} | {worst:.2f} | " + " | ".join(f"{v:.2f}" for v in vals) +
                         f" | {time.perf_counter() - t0:.0f} |")
            print(lines[-1], flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
