"""docs/design.md's import arrows, read from the source with `ast` (nothing is imported).

- workers (prefill_worker, decode_worker) never import each other, `cluster`, or ray;
- engine imports none of kv_transfer / prefill_worker / decode_worker / cluster / ray / grpc;
- kv_transfer imports engine (types) and grpc only: no worker, no cluster, no ray;
- only cluster imports ray; grpc only under kv_transfer/, in one hand-written module (generated
  `*_pb2*.py` stubs also import grpc and live there too);
- scheduler, request and page-pool modules, and the planner's core, are pure Python: no torch, grpc or
  ray, directly or through what they import (Python runs every parent package's `__init__` too);
- proto/ holds .proto files only, never a Python package; unit tests never import ray.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "kv_transfer", "prefill_worker", "decode_worker", "cluster")
WORKERS = ("prefill_worker", "decode_worker")
PURE = ("engine.scheduler", "engine.request", "engine.kv_cache.allocator", "engine.kv_cache.block_table")
# the planner's core rooms (inputs, latency models, simulators, search; every module in them) and its GPU table
# readers and fit: pure Python; its profiler and reports are not
PLANNER_PURE = ("cluster.planner.errors", "cluster.planner.calibrate.gpu_fit", "cluster.planner.calibrate.vidur_tables",
                "cluster.planner.calibrate.moe_check",
                *(f"cluster.planner.{room}.{p.stem}" for room in ("inputs", "latency", "sim", "search")
                  for p in sorted((ROOT / "cluster" / "planner" / room).glob("*.py")) if p.stem != "__init__"))
PURE += PLANNER_PURE
NOT_PURE = {"torch", "grpc", "ray"}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _import_nodes(tree: ast.Module, eager_only: bool):
    """Import nodes anywhere, or (eager_only) only those run when the module is imported: not inside a
    function body and not under `if TYPE_CHECKING:`."""
    if not eager_only:
        yield from (n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)))
        return
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
        else:
            stack.extend(ast.iter_child_nodes(node))


def imports_in_source(source: str, module: str, is_package: bool, eager_only: bool = False) -> set[str]:
    """Absolute dotted names imported in the source (function-level imports too, unless eager_only)."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    names: set[str] = set()
    for node in _import_nodes(ast.parse(source), eager_only):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        else:
            if node.level:
                base = package[:len(package) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module
            names.add(prefix)
            names.update(f"{prefix}.{a.name}" for a in node.names if a.name != "*")  # maybe submodules
    return names


def top(name: str) -> str:
    return name.split(".")[0]


def collect() -> tuple[dict[str, tuple[Path, set[str]]], dict[str, set[str]]]:
    """module -> (path, every import); module -> imports executed at import time."""
    mods, eager = {}, {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            name, src, is_pkg = module_name(path), path.read_text(), path.name == "__init__.py"
            mods[name] = (path, imports_in_source(src, name, is_pkg))
            eager[name] = imports_in_source(src, name, is_pkg, eager_only=True)
    return mods, eager


MODS, EAGER = collect()


def violations(where, forbidden: set[str], skip=lambda path: False) -> list[str]:
    out = []
    for name, (path, imps) in MODS.items():
        if where(name) and not skip(path):
            bad = sorted({top(i) for i in imps} & forbidden)
            if bad:
                out.append(f"{path.relative_to(ROOT)} imports {', '.join(bad)}")
    return out


def in_pkg(*pkgs):
    return lambda name: top(name) in pkgs


def is_generated(path: Path) -> bool:
    return path.stem.endswith("_pb2") or path.stem.endswith("_pb2_grpc")


# ---- the checker itself ------------------------------------------------------------------------
def test_checker_sees_the_tree_and_resolves_relative_imports():
    assert sum(top(m) == "engine" for m in MODS) >= 10, "engine sources not found"
    assert "engine.kv_cache.allocator" in MODS["engine.kv_cache.block_table"][1]
    src = "import ray.util\nfrom .. import cluster\nfrom ..engine.kv_cache import allocator\n" \
          "def f():\n    from . import proposer\n    import grpc\n"
    got = imports_in_source(src, "decode_worker.sub.mod", False)
    assert {"ray.util", "decode_worker.cluster", "decode_worker.engine.kv_cache.allocator",
            "decode_worker.sub.proposer", "grpc"} <= got
    got = imports_in_source("from .kv_cache import spec\n", "engine", True)
    assert "engine.kv_cache.spec" in got
    lazy = "import a\nif TYPE_CHECKING:\n    import b\nclass C:\n    import c\ndef f():\n    import d\n"
    assert imports_in_source(lazy, "m", False, eager_only=True) == {"a", "c"}
    assert imports_in_source(lazy, "m", False) == {"a", "b", "c", "d"}


# ---- the arrows --------------------------------------------------------------------------------
@pytest.mark.parametrize("worker", WORKERS)
def test_workers_import_no_other_worker_cluster_or_ray(worker):
    other = {w for w in WORKERS if w != worker}
    assert violations(in_pkg(worker), other | {"cluster", "ray"}) == []


def test_engine_imports_no_transport_worker_cluster_ray_or_grpc():
    assert violations(in_pkg("engine"), {"kv_transfer", *WORKERS, "cluster", "ray", "grpc"}) == []


def test_kv_transfer_imports_no_worker_cluster_or_ray():
    assert violations(in_pkg("kv_transfer"), {*WORKERS, "cluster", "ray"}) == []


def test_only_cluster_imports_ray():
    assert violations(lambda n: top(n) != "cluster", {"ray"}) == []


def test_grpc_only_in_one_kv_transfer_module():
    assert violations(lambda n: top(n) != "kv_transfer", {"grpc"}) == []
    users = [str(p.relative_to(ROOT)) for n, (p, imps) in MODS.items()
             if top(n) == "kv_transfer" and not is_generated(p) and "grpc" in {top(i) for i in imps}]
    assert len(users) <= 1, f"grpc imported by several kv_transfer modules: {users}"


def test_pure_python_modules_import_no_torch_grpc_or_ray_directly():
    for name in PURE:
        assert name in MODS, f"{name} not found"
    assert violations(lambda n: n in PURE, NOT_PURE) == []


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _internal_deps(name: str) -> set[str]:
    """In-tree modules that importing `name` executes: its parent packages and what it imports."""
    deps = {p for p in _parents(name) if p in MODS}
    for imp in EAGER[name]:
        deps.update(m for m in _parents(imp) + [imp] if m in MODS)
    deps.discard(name)
    return deps


def _import_chain(start: str, forbidden: set[str]) -> list[str] | None:
    """Shortest in-tree chain from `start` to a module importing something forbidden, else None."""
    prev, queue = {start: None}, [start]
    while queue:
        name = queue.pop(0)
        bad = sorted({top(i) for i in EAGER[name]} & forbidden)
        if bad:
            chain = [name]
            while prev[chain[-1]] is not None:
                chain.append(prev[chain[-1]])
            return list(reversed(chain)) + [bad[0]]
        for d in sorted(_internal_deps(name)):
            if d not in prev:
                prev[d] = name
                queue.append(d)
    return None


def test_pure_python_modules_import_no_torch_grpc_or_ray_transitively():
    chains = {name: _import_chain(name, NOT_PURE) for name in PURE}
    bad = {n: " -> ".join(c) for n, c in chains.items() if c}
    assert not bad, "pure-Python modules pull in torch/grpc/ray:\n" + "\n".join(bad.values())


def test_proto_is_not_a_python_package():
    proto = ROOT / "proto"
    assert not (proto / "__init__.py").exists()
    assert not list(proto.rglob("*.py")) if proto.exists() else True


def test_unit_tests_import_no_ray():
    here = Path(__file__).resolve().parent
    bad = [p.name for p in here.rglob("*.py")
           if "ray" in {top(i) for i in imports_in_source(p.read_text(), module_name(p), p.name == "__init__.py")}]
    assert bad == []


# ---- the serving path's room (cluster/serving/: its map is in its __init__) ----------------------
# Its modules in layers: each may import only modules of earlier layers (so the imports run one way, with
# no cycle); only `actors`, `placement` and `ray_pools` import ray, and the router imports none of them;
# outside the room only the launcher imports them (`ray_pools`: the Ray assembly).
SERVING_LAYERS = (("autoscale_evidence",),
                  ("tasks", "flight", "membership", "intake", "prefix_routing", "worker_loop", "placement",
                   "autoscale_policy"),
                  ("holdings", "actors", "autoscale_capacity", "autoscaler"), ("recovery",), ("admission", "scaling"),
                  ("router",), ("ray_pools",))
RAY_MODULES = ("cluster.serving.actors", "cluster.serving.placement", "cluster.serving.ray_pools")


def test_the_serving_room_imports_one_way_and_only_its_ray_modules_import_ray():
    rank = {f"cluster.serving.{m}": i for i, layer in enumerate(SERVING_LAYERS) for m in layer}
    room = {n for n in MODS if n.startswith("cluster.serving.")}
    assert room == set(rank), f"modules of cluster/serving/ not in SERVING_LAYERS: {sorted(room ^ set(rank))}"
    backwards = [f"{n} imports {i}" for n in room for i in MODS[n][1] if i in rank and rank[i] >= rank[n]]
    assert backwards == []
    assert violations(lambda n: n in room and n not in RAY_MODULES, {"ray"}) == []
    assert not {i for n in room - set(RAY_MODULES) for i in MODS[n][1]} & set(RAY_MODULES)
    assert EAGER["cluster.serving"] == set(), "cluster/serving/__init__.py must import nothing"
    users = sorted(n for n, (_, imps) in MODS.items() if n not in room and set(RAY_MODULES) & imps)
    assert users == ["cluster.launch"], users


def test_the_serving_path_left_its_old_places():
    old = ("router", "admission", "recovery", "flight", "worker_loop", "prefix_routing", "actors", "intake")
    assert [m for m in old if (ROOT / "cluster" / f"{m}.py").exists()] == []
