"""Model loading: GGUF converted once under a lock (two processes racing), model dirs, typed errors."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine.errors import UnknownModelError, UnsupportedArchitectureError
from engine.loader import bundled_gguf, load_config, resolve_model
from tests.tiny_models import write_tiny

RESOLVE = "import json, os; from engine.loader import resolve_model; print(json.dumps({'pid': os.getpid(), 'path': str(resolve_model('smollm2-135m'))}))"


def _start(cache):
    env = {"PDSERVE_CACHE": str(cache), "PATH": "/usr/bin:/bin"}
    return subprocess.Popen([sys.executable, "-c", RESOLVE], env=env, stdout=subprocess.PIPE, text=True)


def test_two_processes_convert_once(tmp_path, monkeypatch):
    """The real SmolLM2 GGUF (the suite's only conversion of it: the other tests read the user's cache), two
    processes racing on an empty cache: one converts, the other waits and reuses it, no temporary dir is left,
    and a later start (here in-process: a third interpreter cost seconds and checked nothing more) converts
    nothing."""
    procs = [_start(tmp_path), _start(tmp_path)]
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert results[0]["path"] == results[1]["path"]
    target = results[0]["path"]
    by = json.loads(open(f"{target}/converted_by.json").read())["pid"]
    assert by in {r["pid"] for r in results}, "the cache was converted by neither process"
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".convert-")]
    assert not leftovers, f"temporary conversion dirs left: {leftovers}"
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    assert str(resolve_model("smollm2-135m")) == target
    assert json.loads(open(f"{target}/converted_by.json").read())["pid"] == by, "converted a second time"
    cfg = load_config(target)
    assert (cfg.model_type, cfg.num_layers, cfg.num_kv_heads) == ("llama", 30, 3)


def test_gguf_path_and_model_dir(tmp_path, smollm2_dir):
    assert resolve_model(str(bundled_gguf("smollm2-135m"))) == smollm2_dir
    tiny = write_tiny("qwen2", tmp_path / "qwen")
    assert resolve_model(str(tiny)) == tiny


def test_bad_paths_are_typed_errors(tmp_path):
    with pytest.raises(UnknownModelError):
        resolve_model(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UnknownModelError, match="config.json"):
        resolve_model(str(tmp_path / "empty"))
    d = write_tiny("llama", tmp_path / "gpt")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="llama"):
        load_config(d)
