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
import subprocess
import sys
from pathlib import Path

import pytest

from cluster import cli
from cluster.planner.commands import plan_cmd
from cluster.planner.search.plan_search import search

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


# ---- the scripts under bench/ --------------------------------------------------------------------------
# Every bench script a page names exists, bench/README.md names every script (one with a `__main__` or a
# shell script), each finds the repository root from its own folder, and each parses `--help` (its imports
# resolve: a module moved without its bench scripts fails here, not at a person's next run).
BENCH_DIR = ROOT / "bench"
BENCH_README = BENCH_DIR / "README.md"
BENCH_PATH = re.compile(r"(?<![\w/.-])bench/[\w./-]*?\w\.(?:py|sh)\b")  # not cluster/bench/...
ROOT_OF = re.compile(r"Path\(__file__\)(?:\.resolve\(\))?(?:\.parents\[(\d+)\]|((?:\.parent)+))")


def bench_files(suffixes=(".py", ".sh")) -> list[Path]:
    """The tracked files under bench/ (every file without git: an exported tree), results folders aside."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "bench"], cwd=ROOT, capture_output=True, check=True, timeout=60)
        files = [ROOT / n for n in out.stdout.decode().split("\0") if n]
    except (OSError, subprocess.SubprocessError):
        files = []
    files = files or [p for p in BENCH_DIR.rglob("*") if not {"out", "__pycache__"} & set(p.parts)]
    return sorted(p for p in files if p.suffix in suffixes and p.is_file()
                  and not any(part.endswith("results") for part in p.relative_to(BENCH_DIR).parts))


def bench_scripts() -> list[Path]:
    """The runnable files under bench/: shell scripts and modules with a `__main__` block (the rest are
    libraries of a script beside them)."""
    return [p for p in bench_files() if p.suffix == ".sh" or "__main__" in p.read_text()]


def test_every_bench_script_the_docs_name_exists():
    missing = {}
    for page in [*PAGES, BENCH_README]:
        gone = sorted({m.group(0) for m in BENCH_PATH.finditer(page.read_text())}
                      - {str(p.relative_to(ROOT)) for p in BENCH_DIR.rglob("*")})
        if gone:
            missing[str(page.relative_to(ROOT))] = gone
    assert not missing, f"pages name bench scripts that do not exist: {missing}"


def test_bench_readme_names_every_script():
    named = {m.group(0) for m in BENCH_PATH.finditer(BENCH_README.read_text())}
    text = BENCH_README.read_text()
    # a row may name a second script of its folder by its file name alone (`step_power.py` / `step_compare.py`)
    unnamed = [str(p.relative_to(ROOT)) for p in bench_scripts()
               if str(p.relative_to(ROOT)) not in named and f"`{p.name}`" not in text]
    assert not unnamed, f"bench/README.md does not name: {unnamed}"
    assert len(bench_scripts()) >= 20


def test_every_bench_script_finds_the_repository_root_from_its_own_folder():
    wrong = []
    for p in bench_files((".py",)):
        for m in ROOT_OF.finditer(p.read_text()):
            up = int(m.group(1)) if m.group(1) is not None else m.group(2).count(".parent") - 1
            if up >= 1 and p.resolve().parents[up] != ROOT:  # parents[0] is the script's own folder
                wrong.append(f"{p.relative_to(ROOT)}: {m.group(0)} is {p.resolve().parents[up]}")
    assert not wrong, wrong


def test_every_bench_script_parses_help(tmp_path):
    """One interpreter runs each script's `--help` as `python bench/...` would (`__main__`, argv), from a
    folder outside the repository: a few seconds in all, where a process per script would import torch ~20
    times."""
    scripts = [str(p) for p in bench_scripts() if p.suffix == ".py"]
    probe = ("import contextlib, io, runpy, sys\n"
             "bad = []\n"
             "for path in sys.argv[1:]:\n"
             "    sys.argv, out = [path, '--help'], io.StringIO()\n"
             "    try:\n"
             "        with contextlib.redirect_stdout(out):\n"
             "            runpy.run_path(path, run_name='__main__')\n"
             "        bad.append(f'{path}: no exit')\n"
             "    except SystemExit as e:\n"
             "        if e.code not in (0, None) or 'usage' not in out.getvalue():\n"
             "            bad.append(f'{path}: exit {e.code}')\n"
             "    except Exception as e:\n"
             "        bad.append(f'{path}: {type(e).__name__}: {e}')\n"
             "print('\\n'.join(bad))\n")
    r = subprocess.run([sys.executable, "-c", probe, *scripts], cwd=tmp_path, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and not r.stdout.strip(), r.stdout + r.stderr[-3000:]
