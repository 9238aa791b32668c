"""`pdserve plan`'s output for the docs' commands stays byte for byte what it was (issue 33: the planner's
modules moved into rooms; nothing a user sees may change but module paths).

Each case is a `pdserve plan` command of docs/planner.md run as written from the repository root, with the
search narrowed as tests/integration/test_doc_commands.py narrows it (one token budget, one verified plan
per mode), so a case takes seconds. What is compared with tests/data/planner_output/<case>/: the terminal
output, the spec written and the report's text files (report.md, plan.json / designs.json), after the
wall-clock seconds and the temporary folder are masked. The pictures are not compared (matplotlib's bytes
are not ours to pin).

To regenerate after an intended change of the planner's output:
    PDSERVE_REGEN_PLANNER_OUTPUT=1 .venv/bin/python -m pytest tests/unit/test_planner_output_stable.py
and review the fixture's diff.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import sys
from pathlib import Path

import pytest

from cluster import cli
from cluster.planner.commands import designs_cmd, plan_cmd
from cluster.planner.search.designs import plan_designs
from cluster.planner.search.plan_search import search

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "data" / "planner_output"
REGEN = os.environ.get("PDSERVE_REGEN_PLANNER_OUTPUT") == "1"
VIDUR = ROOT / "data" / "gpu_profiles" / "vidur"

# case -> argv after `pdserve`, as the docs write them (the last case: docs' `--profile my-a100/` with the
# shipped A100 tables standing in for the user's folder, at one node)
CASES = {
    "h100_llama3_8b": [
        "plan", "--model", "llama-3-8b", "--hardware", "h100", "--nodes", "4", "--gpus-per-node", "8",
        "--workload", "data/workloads/azure_llm_2023_conv.csv", "--rate", "300", "--ttft-ms", "250",
        "--tpot-ms", "100", "--out", "cluster.yaml", "--report", "plan-report/"],
    "cpu_local_smollm2": [
        "plan", "--model", "smollm2-135m", "--hardware", "cpu-local", "--gpus-per-node", "2",
        "--profile", "cpu-local-smollm2", "--input-len", "uniform:100:400", "--output-len", "32", "--rate", "0.5",
        "--ttft-ms", "2000", "--tpot-ms", "150", "--spec-model", "smollm2-135m", "--out", "plan-local.yaml"],
    "designs_h100_a100": [
        "plan", "--model", "llama-2-70b", "--hardware", "h100,a100", "--objective", "cost", "--nodes", "2",
        "--workload", "data/workloads/azure_llm_2023_conv.csv", "--rate", "10", "--ttft-ms", "2000",
        "--tpot-ms", "100", "--out", "cluster.yaml", "--report", "designs/"],
    "a100_tables_on_the_spot": [
        "plan", "--model", "llama-3-8b", "--hardware", "a100", "--gpus-per-node", "4",
        "--profile", ",".join(f"data/gpu_profiles/vidur/{n}" for n in (
            "a100_meta-llama_Meta-Llama-3-8B_mlp.csv", "a100_dgx_all_reduce.csv")),
        "--workload", "data/workloads/azure_llm_2023_conv.csv", "--rate", "10", "--ttft-ms", "2000",
        "--tpot-ms", "100", "--out", "cluster.yaml"],
}
NARROW = dict(top_k=1, verify_per_mode=1, prefill_budgets=(2048,), coloc_budgets=(2048,))
# wall-clock seconds: every place the planner prints or writes one
SECONDS = [re.compile(p) for p in (
    r"(search:? )\d+\.\d+( s)", r"(total )\d+\.\d+( s)", r"(per-instance goodputs )\d+\.\d+( s)",
    r"(whole-plan checks )\d+\.\d+( s)", r'("search_seconds": )[0-9.e+-]+()')]


def _masked(text: str, tmp: Path) -> str:
    text = text.replace(str(tmp), "<tmp>")
    for p in SECONDS:
        text = p.sub(r"\1<s>\2", text)
    return text


def _retarget(argv: list[str], tmp: Path) -> list[str]:
    argv = list(argv)
    for flag in ("--out", "--report"):
        if flag in argv:
            k = argv.index(flag) + 1
            argv[k] = str(tmp / argv[k])
    return argv


def run_case(argv: list[str], tmp: Path, monkeypatch) -> dict[str, str]:
    """The case's outputs (file name -> masked text): `stdout`, the spec and the report's text files."""
    monkeypatch.chdir(ROOT)  # the docs' paths are relative to the repository root
    monkeypatch.setattr(sys, "argv", ["pdserve", *argv])  # the spec's header names the command as typed
    monkeypatch.setattr(plan_cmd, "search", lambda req: search(dataclasses.replace(req, **NARROW)))
    monkeypatch.setattr(designs_cmd, "plan_designs",
                        lambda req, *a: plan_designs(dataclasses.replace(req, **NARROW), *a))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(_retarget(argv, tmp))
    assert rc == 0, err.getvalue()
    files = {"stdout": out.getvalue()}
    for path in sorted(tmp.rglob("*")):
        if path.is_file() and path.suffix != ".png":
            files[str(path.relative_to(tmp))] = path.read_text()
    return {name: _masked(text, tmp) for name, text in files.items()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_output_is_unchanged(case, tmp_path, monkeypatch):
    got = run_case(CASES[case], tmp_path, monkeypatch)
    folder = FIXTURES / case
    if REGEN:
        for name, text in got.items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(text)
    want = {str(p.relative_to(folder)): p.read_text() for p in sorted(folder.rglob("*")) if p.is_file()}
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name] == want[name], f"{case}/{name} changed"
