"""Hostile inputs, each row a test: YAML specs (python tags, alias bombs, duplicate keys, syntax errors, wrong
top-level types) end in a `SpecError` naming the place, without running code or expanding the bomb; a
static scan fails if a deserializer that can run code (pickle, cloudpickle, dill, marshal, shelve, joblib,
`torch.load`, `numpy.load(allow_pickle=True)`) appears on the KV data plane, the HTTP path or the spec
reader; and another fails if any YAML in the packages is read by a loader that builds Python objects
(`yaml.load` without a SafeLoader, `unsafe_load`, `full_load`, `Loader`/`FullLoader`/`UnsafeLoader`)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from cluster.spec import load_spec
from cluster.spec_errors import SpecError

ROOT = Path(__file__).resolve().parents[2]
BOMB = "".join(f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefg", "bcdefgh"))
BOMB = 'a: &a ["x", "x", "x", "x", "x", "x", "x", "x", "x"]\n' + BOMB  # h: 9^8 = 43M strings if expanded

SPECS = {  # name: (YAML text, what the error must name)
    "python_object_apply": ('model: !!python/object/apply:os.system ["true"]\npools: {}\n', "line 1"),
    "python_name": ("model: !!python/name:os.system\npools: {}\n", "python/name"),
    "python_module": ("model: !!python/module:os\npools: {}\n", "python/module"),
    "alias_bomb_unknown_key": (BOMB + "model: m\npools: {decode: {replicas: 1}}\n", "unknown key"),
    "alias_bomb_in_a_mapping_field": (BOMB + "model: m\npools: {decode: {replicas: 1, resources: *h}}\n",
                                      "pools.decode.resources"),
    "duplicate_key": ("model: m\nmodel: n\npools: {}\n", "duplicate key 'model'"),
    "duplicate_nested_key": ("model: m\npools:\n  decode: {replicas: 1}\n  decode: {replicas: 2}\n",
                             "duplicate key 'decode'"),
    "syntax_error": ("model: m\npools: {decode: [\n", "YAML syntax error"),
    "tab_indent": ("model: m\npools:\n\tdecode: {}\n", "line 3"),
    "top_level_list": ("- model\n- pools\n", "top level must be a mapping"),
    "empty": ("", "empty"),
    "unknown_top_key": ("model: m\npools: {decode: {replicas: 1}}\nplugins: [x]\n", "unknown key 'plugins'"),
    "wrong_type": ("model: m\npools: {decode: {replicas: many}}\n", "pools.decode.replicas"),
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_hostile_spec_is_a_spec_error_naming_the_place(name, tmp_path):
    text, expect = SPECS[name]
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as err:
        load_spec(path)
    assert expect in str(err.value), str(err.value)


# The KV data plane and the HTTP path (and the router behind it): nothing here may deserialize bytes into
# objects that can run code. Ray's own control plane (cluster/serving/actors.py) is trusted inside an
# authenticated cluster and is outside this scan.
SCANNED = ["kv_transfer", "cluster/http", "cluster/serving", "cluster/serving_api.py", "cluster/server.py",
           "cluster/client.py", "prefill_worker", "decode_worker", "cluster/spec.py",
           "cluster/spec_errors.py", "cluster/spec_sections.py", "cluster/launch.py", "cluster/local_backend.py"]
NOT_SCANNED = {"cluster/serving/actors.py"}
BANNED_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "marshal", "shelve", "joblib"}
BANNED_CALLS = {("torch", "load"), ("pickle", "loads"), ("pickle", "load"), ("numpy", "load"), ("np", "load")}


def scanned_files() -> list[Path]:
    out = []
    for entry in SCANNED:
        p = ROOT / entry
        out += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    return [p for p in out if not p.name.endswith("_pb2.py") and not p.name.endswith("_pb2_grpc.py")
            and str(p.relative_to(ROOT)) not in NOT_SCANNED]


def offences(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in BANNED_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in BANNED_MODULES:
            found.append(node.module)
        elif isinstance(node, ast.ImportFrom) and node.module == "torch" and any(a.name == "load" for a in node.names):
            found.append("from torch import load")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if (node.value.id, node.attr) in BANNED_CALLS:
                found.append(f"{node.value.id}.{node.attr}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "__import__":
            found.append("__import__")
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    return [f"{where}:{what}" for what in found]


def test_no_code_running_deserializer_on_the_kv_or_http_path():
    files = scanned_files()
    assert len(files) > 15 and all(p.exists() for p in files), files
    bad = [o for p in files for o in offences(p)]
    assert not bad, f"unsafe deserialization on the KV/HTTP path: {bad}"


def test_the_scan_catches_what_it_bans(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import pickle\nfrom cloudpickle import loads\nimport torch\nx = torch.load('f')\n")
    assert len(offences(probe)) == 3, offences(probe)


# YAML: only safe loaders anywhere in the packages (specs, profiles, workloads are all untrusted files).
PACKAGES = ["cluster", "engine", "kv_transfer", "prefill_worker", "decode_worker", "bench", "scripts"]
SAFE_LOADERS = {"SafeLoader", "CSafeLoader", "BaseLoader", "CBaseLoader", "_StrictLoader"}
UNSAFE_YAML = {"unsafe_load", "unsafe_load_all", "full_load", "full_load_all", "Loader", "FullLoader",
               "UnsafeLoader", "CLoader", "CFullLoader", "CUnsafeLoader"}


def yaml_offences(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "yaml":
            if node.attr in UNSAFE_YAML:
                found.append(f"yaml.{node.attr}")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("load", "load_all")
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "yaml"):
            loader = next((k.value for k in node.keywords if k.arg == "Loader"), node.args[1] if len(node.args) > 1
                          else None)
            name = loader.attr if isinstance(loader, ast.Attribute) else getattr(loader, "id", None)
            if name not in SAFE_LOADERS:
                found.append(f"yaml.{node.func.attr} with Loader={name}")
        if isinstance(node, ast.ImportFrom) and node.module == "yaml":
            found += [f"from yaml import {a.name}" for a in node.names if a.name in UNSAFE_YAML | {"load", "load_all"}]
    return [f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{f}" for f in found]


def test_yaml_is_only_read_by_safe_loaders():
    files = [p for d in PACKAGES if (ROOT / d).is_dir() for p in sorted((ROOT / d).rglob("*.py"))]
    assert len(files) > 50, len(files)
    bad = [o for p in files for o in yaml_offences(p)]
    assert not bad, f"YAML read by a loader that can build Python objects: {bad}"


def test_the_yaml_scan_catches_what_it_bans(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import yaml\nyaml.load(t)\nyaml.load(t, Loader=yaml.FullLoader)\nyaml.unsafe_load(t)\n"
                     "yaml.load(t, yaml.SafeLoader)\nyaml.safe_load(t)\nfrom yaml import full_load\n")
    assert len(yaml_offences(probe)) == 5, yaml_offences(probe)
