"""docs/design.md's import rules as import-linter contracts, and no import cycle between modules.

- `lint-imports` checks the contracts of pyproject.toml's [tool.importlinter] (the layers cluster ->
  workers -> kv_transfer -> engine, where ray and grpc may be imported, the pure engine modules, the
  planner's rooms and its pure core); it runs in a subprocess (its CLI reconfigures logging, which would leak into other tests);
- grimp (import-linter's graph library) builds the import graph of the five packages, and every strongly
  connected set of modules (modules importing each other, directly or round a loop) is listed with the
  imports that close it. Imports inside functions and under TYPE_CHECKING count: a lazy import back is
  still a cycle of the map, only deferred.

tests/unit/test_imports.py keeps the rules about what `import X` executes (eager imports, parent packages).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "kv_transfer", "prefill_worker", "decode_worker", "cluster")


def strongly_connected(graph: grimp.ImportGraph) -> list[list[str]]:
    """Sets of two or more modules that reach each other by imports (Tarjan, iterative), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    members.append(m)
                    if m == node:
                        break
                if len(members) > 1:
                    out.append(sorted(members))
    return sorted(out)


def describe(graph: grimp.ImportGraph, members: list[str]) -> str:
    """The imports among one cycle's modules, with their lines: what to cut."""
    inside = set(members)
    lines = [" <-> ".join(members)]
    for importer in members:
        for imported in sorted(graph.find_modules_directly_imported_by(importer) & inside):
            where = sorted({d["line_number"] for d in graph.get_import_details(importer=importer, imported=imported)})
            lines.append(f"    {importer} -> {imported} (line {', '.join(map(str, where))})")
    return "\n".join(lines)


def test_the_cycle_finder_finds_loops_and_only_loops():
    g = grimp.ImportGraph()
    for a, b in [("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d"), ("p.d", "p.e"), ("p.e", "p.d"),
                 ("p.x", "p.a"), ("p.y", "p.y")]:
        g.add_import(importer=a, imported=b)
    assert strongly_connected(g) == [["p.a", "p.b", "p.c"], ["p.d", "p.e"]]
    g.remove_import(importer="p.e", imported="p.d")
    assert strongly_connected(g) == [["p.a", "p.b", "p.c"]]


def source_modules() -> set[str]:
    out = set()
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def test_no_import_cycle_between_modules():
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    unseen = sorted(source_modules() - set(graph.modules))  # a folder without __init__.py is skipped
    assert not unseen, f"modules outside the import graph (a package missing its __init__.py?): {unseen}"
    cycles = strongly_connected(graph)
    assert not cycles, f"{len(cycles)} import cycle(s):\n" + "\n".join(describe(graph, c) for c in cycles)


def test_import_linter_contracts_are_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    if not lint.exists():
        pytest.fail(f"{lint} missing: import-linter is in the test extras (make venv installs it)")
    run = subprocess.run([str(lint), "--no-cache", "--no-logo"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-20000:] + run.stderr[-5000:]
    assert "BROKEN" not in run.stdout and " KEPT" in run.stdout
