"""Plans that change with the GPU step model (issue 24): the planner's own GPU scenarios planned before
(the roofline of deploy/hardware.yaml, at the commit before cluster/planner/gpu_latency.py landed) and
after (this tree), side by side.

    python bench/planner_gpu_plans.py --out bench/planner_gpu_plans.md
    python bench/planner_gpu_plans.py --only llama-3-8b-h100-8 --out /tmp/one.md     # one scenario
    python bench/planner_gpu_plans.py --before 2c278dc --jobs 1                      # another baseline

Order: (1) `git worktree add --detach` a temporary checkout of --before (removed at the end, also on
errors); (2) per scenario, `pdserve plan ... --report DIR` in each tree (PYTHONPATH = that tree, this
interpreter), the chosen plan read from DIR/plan.json; (3) per model x GPU, each tree's latency model
prices one instance per TP degree (a 1,024-token prefill, a decode step of 32 sequences x 1,024 tokens):
the step times behind a changed choice; (4) markdown: the command lines, a table of the chosen plans
before and after, and for every plan that changed: both plans, each side's own `why` and the step times.

Scenarios (SCENARIOS): Llama-3-8B and Llama-3-70B on 8 and 32 H100 and A100 GPUs (8 per node) on the Azure
2023 conversation trace (data/workloads), and DistServe's OPT settings (OSDI'24, Table 1: chatbot
OPT-13B/66B/175B, code completion and summarization on OPT-66B, with its SLOs) on 4 nodes of 8 A100s with
25 Gb/s between nodes (`--inter-node-gbs 3`, the README's figure for it). DistServe's datasets (ShareGPT,
HumanEval, LongBench) are not in data/: their lengths are uniform ranges of about their means, within
OPT's 2,048 positions. Rates are set so that a plan needs a good part of its GPUs (one, Llama-3-8B at 40
req/s on 8 A100s, beyond what the step model lets them sustain); Llama-3-70B gets TTFT 1 s (at 500 ms no
A100 configuration meets it under the step model: TP 8 prefills the trace's p90 prompt in ~600 ms). Each plan takes 10-60 s
on a quiet core (the planner has no quick mode): the whole run is minutes; `--jobs 2` runs two at once.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEFORE = "2c278dc"  # parent of 23a4c09 (`git log -- cluster/planner/gpu_latency.py`: the GPU model's first commit)
CONV = ROOT / "data" / "workloads" / "azure_llm_2023_conv.csv"  # this tree's copy, for both trees


@dataclass(frozen=True)
class Scenario:
    name: str
    model: str
    hardware: str
    args: tuple[str, ...]  # the rest of the `pdserve plan` command line


def _llama(model: str, hw: str, gpus: int, rate: float, ttft: int, tpot: int) -> Scenario:
    return Scenario(f"{model}-{hw}-{gpus}", model, hw,
                    ("--nodes", str(gpus // 8), "--gpus-per-node", "8", "--workload", str(CONV), "--rate", str(rate),
                     "--ttft-ms", str(ttft), "--tpot-ms", str(tpot)))


def _distserve(name: str, model: str, inp: str, out: str, rate: float, ttft: int, tpot: int) -> Scenario:
    return Scenario(f"distserve-{name}", model, "a100",
                    ("--nodes", "4", "--gpus-per-node", "8", "--inter-node-gbs", "3", "--input-len", inp,
                     "--output-len", out, "--rate", str(rate), "--ttft-ms", str(ttft), "--tpot-ms", str(tpot)))


SCENARIOS = (
    _llama("llama-3-8b", "h100", 8, 80, 250, 100), _llama("llama-3-8b", "h100", 32, 300, 250, 100),
    _llama("llama-3-8b", "a100", 8, 40, 250, 100), _llama("llama-3-8b", "a100", 32, 150, 250, 100),
    _llama("llama-3-70b", "h100", 8, 8, 1000, 100), _llama("llama-3-70b", "h100", 32, 30, 1000, 100),
    _llama("llama-3-70b", "a100", 8, 2, 1000, 100), _llama("llama-3-70b", "a100", 32, 8, 1000, 100),
    _distserve("chatbot-opt-13b", "opt-13b", "uniform:100:1500", "uniform:50:450", 20, 250, 100),
    _distserve("chatbot-opt-66b", "opt-66b", "uniform:100:1500", "uniform:50:450", 6, 2500, 150),
    _distserve("chatbot-opt-175b", "opt-175b", "uniform:100:1500", "uniform:50:450", 2, 4000, 200),
    _distserve("code-opt-66b", "opt-66b", "uniform:60:300", "uniform:30:200", 10, 125, 200),
    _distserve("summarization-opt-66b", "opt-66b", "uniform:1000:1900", "uniform:40:140", 2, 15000, 150),
)

STEP_SNIPPET = """
import json, sys
from cluster.planner.hardware import load_hardware
from cluster.planner.latency import Parallel
from cluster.planner.models import load_model
from cluster.planner.profiles import latency_model
m, hw = load_model(sys.argv[1]), load_hardware(sys.argv[2])
out = {}
for tp in (1, 2, 4, 8):
    if m.heads % tp == 0:
        lat = latency_model(m, hw, Parallel(tp, 1))
        out[tp] = [lat.prefill(1024, 1024 ** 2), lat.decode(32, 32 * 1024)]
print(json.dumps(out))
"""


def command(s: Scenario, out_dir: Path) -> list[str]:
    return ["pdserve", "plan", "--model", s.model, "--hardware", s.hardware, *s.args,
            "--out", str(out_dir / "cluster.yaml"), "--report", str(out_dir)]


def run_plan(tree: Path, s: Scenario, out_dir: Path, timeout: int) -> dict:
    """The chosen plan of one scenario planned by `tree`: plan.json's fields, or {"error": ...}."""
    out_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "cluster.cli", *command(s, out_dir)[1:]]
    try:
        p = subprocess.run(argv, cwd=tree, env=dict(os.environ, PYTHONPATH=str(tree)),
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"no plan within {timeout} s"}
    if p.returncode != 0 or not (out_dir / "plan.json").exists():
        lines = [ln for ln in (p.stderr + p.stdout).splitlines() if ln.strip()]
        return {"error": lines[-1] if lines else f"exit {p.returncode}"}
    return json.loads((out_dir / "plan.json").read_text())


def step_times(tree: Path, model: str, hw: str) -> dict:
    p = subprocess.run([sys.executable, "-c", STEP_SNIPPET, model, hw], cwd=tree, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(tree)), timeout=120, check=True)
    return {int(k): v for k, v in json.loads(p.stdout).items()}


def describe(plan: dict) -> str:
    """'colocated 3x tp1pp1/b8192 = 3 GPUs' or 'disaggregated [placement] 2x P tp2pp1 + 1x D tp1pp1 = 5 GPUs'."""
    if "error" in plan:
        return f"no plan: {plan['error']}"
    c = plan["chosen"]
    pools = " + ".join(f"{p['replicas']}x {p['phase'][0].upper() if c['mode'] == 'disaggregated' else ''}"
                       f"{' ' if c['mode'] == 'disaggregated' else ''}tp{p['tp']}pp{p['pp']}"
                       f"{'/b' + str(p['token_budget']) if p.get('token_budget') else ''}" for p in c["pools"])
    placement = f" [{c['placement']}]" if c["mode"] == "disaggregated" else ""
    return f"{c['mode']}{placement} {pools} = {c['gpus']} GPUs"


def shape(plan: dict) -> tuple:
    """What 'the chosen plan changed' compares: mode, placement, pools (phase, replicas, TP, PP, budget)."""
    if "error" in plan:
        return ("error",)
    c = plan["chosen"]
    return (c["mode"], c["placement"], tuple((p["phase"], p["replicas"], p["tp"], p["pp"], p.get("token_budget"))
                                             for p in c["pools"]))


def _goodput(plan: dict) -> str:
    if "error" in plan:
        return "-"
    c = plan["chosen"]
    return f"{c['goodput']:.2f} ({c['per_gpu_goodput']:.2f}/GPU)"


def _tps(plan: dict) -> list[int]:
    return sorted({p["tp"] for p in plan["chosen"]["pools"]}) if "error" not in plan else []


def in_short(s: Scenario, b: dict, a: dict, steps: tuple[dict, dict]) -> str:
    """One generated sentence: what the step model priced differently for the instances the plans chose."""
    sb, sa = steps
    tps = sorted(set(_tps(b)) | set(_tps(a))) or [min(sa)]
    priced = "; ".join(f"TP {t}: prefill {1e3 * sb[t][0]:.0f} -> {1e3 * sa[t][0]:.0f} ms, decode step "
                       f"{1e3 * sb[t][1]:.1f} -> {1e3 * sa[t][1]:.1f} ms" for t in tps if t in sa)
    speed = "; ".join(f"TP {t} vs 1: prefill x{sb[1][0] / sb[t][0]:.2f} -> x{sa[1][0] / sa[t][0]:.2f}, decode "
                      f"x{sb[1][1] / sb[t][1]:.2f} -> x{sa[1][1] / sa[t][1]:.2f}" for t in tps if t > 1 and t in sa)
    if "error" in a or "error" in b:
        what = "the plan's feasibility changed" if ("error" in a) != ("error" in b) else "neither side plans it"
    elif _tps(a) != _tps(b):
        what = f"TP {'/'.join(map(str, _tps(b)))} -> {'/'.join(map(str, _tps(a)))}"
    elif a["chosen"]["mode"] != b["chosen"]["mode"]:
        what = f"{b['chosen']['mode']} -> {a['chosen']['mode']}"
    else:
        budgets = [(p.get("token_budget"), q.get("token_budget")) for p, q in zip(b["chosen"]["pools"],
                                                                                  a["chosen"]["pools"])]
        what = (f"same TP, {b['chosen']['gpus']} -> {a['chosen']['gpus']} GPUs (per GPU "
                f"{b['chosen']['per_gpu_goodput']:.2f} -> {a['chosen']['per_gpu_goodput']:.2f} req/s)" +
                "".join(f", token budget {x} -> {y}" for x, y in budgets if x != y))
    return f"In short: {what}. Step times, 1,024-token prefill and 32 x 1,024 decode (before -> after): {priced}" + \
        (f"; speedups {speed}." if speed else ".")


def report(results: list[tuple[Scenario, dict, dict]], steps: dict, before: str, after: str) -> str:
    changed = [r for r in results if shape(r[1]) != shape(r[2])]
    lines = [f"# Plans that change with the GPU step model (issue 24)", "",
             f"Written by `python bench/planner_gpu_plans.py` (re-run it to refresh). Before: the roofline at "
             f"commit {before} (the parent of the GPU model's first commit); after: {after}. Each row is one "
             f"`pdserve plan` run per tree, the command below with `--out`/`--report` pointing to a temporary "
             f"folder; goodput is the planner's predicted req/s of the chosen plan (per GPU). "
             f"{len(changed)} of {len(results)} chosen plans changed.", "",
             "| scenario | before (roofline) | goodput | after (GPU step model) | goodput | changed |",
             "|---|---|---|---|---|---|"]
    for s, b, a in results:
        lines.append(f"| {s.name} | {describe(b)} | {_goodput(b)} | {describe(a)} | {_goodput(a)} | "
                     f"{'**yes**' if shape(b) != shape(a) else 'no'} |")
    lines += ["", "## Commands", ""]
    lines += [f"- {s.name}: `{shlex.join(command(s, Path('OUT')))}`" for s, _, _ in results]
    lines += ["", "## Every changed plan, and why", ""]
    for s, b, a in changed:
        lines += [f"### {s.name}", "", f"- before: {describe(b)}; {b.get('binding', '')}",
                  f"- after: {describe(a)}; {a.get('binding', '')}",
                  f"- before, the planner's why: {b.get('why', b.get('error', ''))}",
                  f"- after, the planner's why: {a.get('why', a.get('error', ''))}"]
        sb, sa = steps[(s.model, s.hardware)]
        lines += ["", in_short(s, b, a, (sb, sa))]
        lines += ["", f"One {s.model} instance on {s.hardware}, TP x1 (before -> after): prefill of 1,024 tokens, "
                      f"decode step of 32 x 1,024; `speedup` = TP 1's time / TP n's:", "",
                  "| TP | prefill ms | prefill speedup | decode step ms | decode speedup |", "|---|---|---|---|---|"]
        for tp in sorted(sa):
            pb, db = sb[tp]
            pa, da = sa[tp]
            lines.append(f"| {tp} | {1e3 * pb:.1f} -> {1e3 * pa:.1f} | {sb[1][0] / pb:.2f} -> {sa[1][0] / pa:.2f} "
                         f"| {1e3 * db:.2f} -> {1e3 * da:.2f} | {sb[1][1] / db:.2f} -> {sa[1][1] / da:.2f} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", default=BEFORE, help="the baseline commit (default: the roofline's last)")
    ap.add_argument("--only", help="comma-separated scenario names")
    ap.add_argument("--out", type=Path, help="write the markdown here (default: print it)")
    ap.add_argument("--jobs", type=int, default=1, help="plans run at once (the machine is shared: 1-2)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per plan")
    args = ap.parse_args(argv)
    picked = [s for s in SCENARIOS if not args.only or s.name in args.only.split(",")]
    after = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip() + (" + uncommitted changes" if subprocess.run(
                               ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip() else "")
    with tempfile.TemporaryDirectory(prefix="gpu-plans-") as tmp:
        base = Path(tmp) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), args.before], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            sides = (("before", base), ("after", ROOT))
            jobs = [(tree, s, Path(tmp) / f"plans-{side}" / s.name) for s in picked for side, tree in sides]
            with ThreadPoolExecutor(args.jobs) as pool:
                plans = list(pool.map(lambda j: run_plan(*j, args.timeout), jobs))
            steps = {(s.model, s.hardware): (step_times(base, s.model, s.hardware),
                                             step_times(ROOT, s.model, s.hardware)) for s in picked}
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, capture_output=True)
    results = [(s, plans[2 * i], plans[2 * i + 1]) for i, s in enumerate(picked)]
    text = report(results, steps, args.before, after)
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
