"""The `pdserve` commands of README.md and docs/*.md that need neither a GPU nor a Ray cluster run as written,
from the repository root, on the repository's own data: `validate` (and every spec in deploy/ besides),
`plan` and `fit-gpu`. Only `--out`/`--report` move to a temporary folder (the docs write into the checkout),
a placeholder folder of your own tables becomes the shipped A100 tables, and single-type plans search a
narrowed space (one token budget, one verified plan per mode, as tests/integration/test_plan_validates.py):
the same command line, a smaller search. `bench` commands are run up to the point where they would start
a server: flags parsed, the workload loaded from data/, the spec variants written and validated.

Every `.venv/bin/pdserve ...` line of the docs is either walked here or named in NOT_WALKED with the reason,
so a command added to the docs is walked or explicitly left out.
"""
from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

import pytest

from cluster import cli
from cluster.planner import plan_cmd
from cluster.planner.search import search

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
WALKED = {"validate", "plan", "fit-gpu"}
# subcommand -> why its doc commands are not run here (each is run elsewhere or needs what a test lacks)
NOT_WALKED = {
    "serve": "serves until stopped (tests/integration/test_bench_local.py starts `pdserve serve` itself)",
    "generate": "--spec starts a Ray cluster and loads the model in it",
    "scale": "needs a running server (tests/integration/test_scale_ray_tiny.py resizes through the same path)",
    "bench": "starts a server and probes it for minutes: here parsed, its workload loaded and its spec variants "
             "written and validated (a live --spec run: tests/integration/test_bench_local.py)",
    "profile": "times the engine for minutes",
}
A100_TABLES = ("a100_meta-llama_Meta-Llama-3-8B_mlp.csv", "a100_dgx_all_reduce.csv")


def doc_commands() -> list[tuple[str, list[str]]]:
    """(page name, argv after `pdserve`) for every `.venv/bin/pdserve` command in a code block of the docs;
    continuation lines joined, trailing comments dropped."""
    out = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            line = lines[i].strip()
            while line.endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line[:-1] + " " + lines[i].strip()
            i += 1
            if line.startswith(".venv/bin/pdserve "):
                argv = shlex.split(line, comments=True)[1:]
                out.append((page.name, argv))
    return out


def _placeholder(argv: list[str]) -> bool:
    return "..." in argv


def _retarget(argv: list[str], tmp: Path) -> list[str]:
    """--out/--report into tmp; a folder of your own tables (`my-a100/`) -> the shipped A100 tables."""
    argv = list(argv)
    for flag in ("--out", "--report"):
        if flag in argv:
            k = argv.index(flag) + 1
            argv[k] = str(tmp / Path(argv[k]).name) + ("/" if argv[k].endswith("/") else "")
    if argv[0] == "fit-gpu" and "my-a100/" in argv:
        mine = tmp / "my-a100"
        mine.mkdir(exist_ok=True)
        for name in A100_TABLES:
            (mine / name).symlink_to(ROOT / "data" / "gpu_profiles" / "vidur" / name)
        argv[argv.index("my-a100/")] = str(mine)
    return argv


def test_every_doc_command_is_walked_or_left_out_with_a_reason():
    cmds = doc_commands()
    subs = {argv[0] for _, argv in cmds}
    assert {"validate", "plan", "fit-gpu"} <= subs, subs
    unknown = subs - WALKED - set(NOT_WALKED)
    assert not unknown, f"doc commands neither walked nor left out: {unknown}"
    walked = [a for _, a in cmds if a[0] in WALKED and not _placeholder(a)]
    assert len(walked) >= 5, walked


@pytest.fixture
def at_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the docs' paths are relative to the repository root


@pytest.fixture
def narrow(monkeypatch):
    def narrowed(req):
        return search(dataclasses.replace(req, top_k=1, verify_per_mode=1, prefill_budgets=(2048,),
                                          coloc_budgets=(2048,)))
    monkeypatch.setattr(plan_cmd, "search", narrowed)


def test_every_spec_in_deploy_validates(at_root, capsys):
    specs = sorted(p for p in (ROOT / "deploy").glob("*.yaml") if p.name != "hardware.yaml")
    assert len(specs) >= 6
    for spec in specs:
        assert cli.main(["validate", str(spec.relative_to(ROOT))]) == 0, capsys.readouterr().err
        assert capsys.readouterr().out.startswith("ok: ")


RUN = [c for c in doc_commands() if c[1][0] in WALKED and not _placeholder(c[1])]


@pytest.mark.parametrize("page, argv", RUN, ids=[f"{p}:{a[0]}:{i}" for i, (p, a) in enumerate(RUN)])
def test_doc_command_runs_as_written(page, argv, at_root, narrow, tmp_path, capsys):
    args = _retarget(argv, tmp_path)
    rc = cli.main(args)
    out, err = capsys.readouterr()
    assert rc == 0, f"{page}: pdserve {shlex.join(argv)}\n{err}"
    if args[0] == "plan":
        spec = Path(args[args.index("--out") + 1])
        assert spec.is_file() and re.search(r"^model: ", spec.read_text(), re.M)
        assert cli.main(["validate", str(spec)]) == 0, capsys.readouterr().err
        if "--report" in args:
            assert (Path(args[args.index("--report") + 1]) / "report.md").is_file()
    if args[0] == "fit-gpu":
        assert "step:" in out and Path(args[args.index("--out") + 1]).is_file()
    assert not list(ROOT.glob("cluster.yaml")) and not list(ROOT.glob("plan-local.yaml"))  # nothing in the checkout


BENCH = [c for c in doc_commands() if c[1][0] == "bench"]


@pytest.mark.parametrize("page, argv", BENCH, ids=[f"{p}:bench:{i}" for i, (p, a) in enumerate(BENCH)])
def test_doc_bench_command_loads_its_workload_and_specs(page, argv, at_root, tmp_path, capsys):
    from cluster.bench.server import spec_variants
    from cluster.bench.workload import TraceScaling, load_workload

    args = cli.build_parser().parse_args(argv)
    scaling = TraceScaling(args.input_scale, args.output_scale, max_input=args.max_input, max_output=args.max_output)
    w = load_workload(args.workload, 5, args.seed, scaling, args.trace_start, args.trace_stride)
    assert len(w) == 5
    paths = [args.spec] if args.spec else list(args.compare or [])
    for variants in spec_variants(paths, args.set, tmp_path):
        for v in variants:
            assert cli.main(["validate", v.path]) == 0, capsys.readouterr().err
