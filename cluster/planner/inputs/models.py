"""Model configs as data: `ModelSpec` (frozen) from `deploy/models/<short-name>.yaml` or an HF config.json.

`load_model("llama-3-8b")` reads the YAML (validated by a pydantic edge model that rejects unknown keys);
so does the model's Hugging Face Hub id (`meta-llama/Meta-Llama-3-8B`, the file's `hf_id`);
`load_model("path/config.json")` (or a model directory holding one) maps the Hugging Face keys of
Llama/Mistral/Qwen2 and OPT configs. The latency models (`roofline`) and the memory model
(`search/configs.py`) read the shape from here: parameters per layer, KV bytes per token. `hf_id`, `architecture`
and `local_dir` say what a planned spec's `model:` names (`spec_writer.spec_model`).
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cluster.planner.errors import BadConfigError, UnknownModelError
from cluster.planner.inputs.paths import deploy_dir, pydantic_problems, read_data

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    max_positions: int
    params: float  # total parameters (stated by the vendor, or counted from the shape)
    gated_mlp: bool = True  # SwiGLU: 3 FFN matrices; OPT's ReLU MLP: 2
    tied_embeddings: bool = False
    learned_positions: bool = False  # OPT: a [max_positions, hidden] position table
    hf_id: str | None = None  # its Hugging Face Hub id (what a planned spec's `model:` names)
    architecture: str = ""  # config.json's architectures[0], e.g. LlamaForCausalLM, OPTForCausalLM
    local_dir: str | None = None  # read from a local folder that also holds *.safetensors (servable as is)

    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer (the matmuls every token pays)."""
        q_out = self.heads * self.head_dim
        kv_out = self.kv_heads * self.head_dim
        attn = self.hidden * q_out + 2 * self.hidden * kv_out + q_out * self.hidden
        return attn + (3 if self.gated_mlp else 2) * self.hidden * self.ffn

    @property
    def counted_params(self) -> int:
        embed = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * self.layer_params + embed + (self.max_positions * self.hidden
                                                          if self.learned_positions else 0)

    def kv_bytes_per_token(self, dtype: str = "bfloat16") -> int:
        """K and V of every layer for one token, whole model (no sharding)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES[dtype]

    def weight_bytes(self, dtype: str = "bfloat16") -> float:
        return self.params * DTYPE_BYTES[dtype]


class _ModelFile(BaseModel):
    """The YAML edge: `deploy/models/*.yaml` keys, unknown keys rejected."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    hf_id: str | None = None
    architecture: str | None = None  # config.json's architectures[0]
    layers: int = Field(ge=1)
    hidden: int = Field(ge=1)
    heads: int = Field(ge=1)
    kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    ffn: int = Field(ge=1)
    vocab: int = Field(ge=1)
    max_positions: int = Field(ge=1)
    params: float | None = Field(None, gt=0)
    gated_mlp: bool = True
    tied_embeddings: bool = False
    learned_positions: bool | None = None  # None: true for OPT-style (no gated MLP) models


def known_models() -> list[str]:
    return sorted(p.stem for p in (deploy_dir() / "models").glob("*.yaml"))


def _spec_from_file(m: _ModelFile) -> ModelSpec:
    learned = (not m.gated_mlp) if m.learned_positions is None else m.learned_positions
    spec = ModelSpec(m.name, m.layers, m.hidden, m.heads, m.kv_heads, m.head_dim, m.ffn, m.vocab,
                     m.max_positions, 0.0, m.gated_mlp, m.tied_embeddings, learned, m.hf_id, m.architecture or "")
    return _with_params(spec, m.params)


def _with_params(spec: ModelSpec, params: float | None) -> ModelSpec:
    from dataclasses import replace
    return replace(spec, params=float(params or spec.counted_params))


def from_hf_config(d: dict[str, Any], name: str) -> ModelSpec:
    """Map a Hugging Face config.json (Llama/Mistral/Qwen2 or OPT keys) to a `ModelSpec`."""
    try:
        heads = d["num_attention_heads"]
        hidden = d["hidden_size"]
        is_opt = d.get("model_type") == "opt"
        ffn = d["ffn_dim"] if is_opt else d["intermediate_size"]
        archs = d.get("architectures") or [""]
        spec = ModelSpec(
            name=name, layers=d["num_hidden_layers"], hidden=hidden, heads=heads,
            kv_heads=d.get("num_key_value_heads") or heads, head_dim=d.get("head_dim") or hidden // heads,
            ffn=ffn, vocab=d["vocab_size"], max_positions=d.get("max_position_embeddings", 2048), params=0.0,
            gated_mlp=not is_opt, tied_embeddings=d.get("tie_word_embeddings", is_opt), learned_positions=is_opt,
            architecture=str(archs[0]))
    except KeyError as e:
        raise BadConfigError(f"{name}: config.json lacks {e.args[0]!r} (a decoder-only transformer config "
                             f"needs num_hidden_layers, hidden_size, num_attention_heads, vocab_size, "
                             f"intermediate_size or ffn_dim)") from None
    return _with_params(spec, None)


# a config.json inside the Hugging Face cache: .../models--ORG--NAME/snapshots/COMMIT/config.json
_HUB_SNAPSHOT = re.compile(r"models--([^/]+)--([^/]+)/snapshots/[^/]+/config\.json$")


def _origin(config: Path) -> dict[str, str]:
    """What a spec may name for a config read from disk: the Hub id of a cache snapshot, or the folder
    itself when it holds the weights (not resolved: a snapshot's files are links into blobs/)."""
    m = _HUB_SNAPSHOT.search(config.absolute().as_posix())
    if m:
        return {"hf_id": f"{m.group(1)}/{m.group(2)}"}
    folder = config.absolute().parent
    return {"local_dir": str(folder)} if any(folder.glob("*.safetensors")) else {}


def by_hub_id(hub_id: str) -> str | None:
    """The short name of the `deploy/models/` file whose hf_id is `hub_id` (case-insensitive), if any."""
    for name in known_models():
        data = read_data(deploy_dir() / "models" / f"{name}.yaml")
        if isinstance(data, dict) and str(data.get("hf_id", "")).lower() == hub_id.lower():
            return name
    return None


def load_model(name_or_path: str) -> ModelSpec:
    """A short name from `deploy/models/` or its Hub id, a config.json, or a directory holding one."""
    from dataclasses import replace

    path = Path(name_or_path)
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if path.suffix == ".json" and path.is_file():
        data = read_data(path)
        if not isinstance(data, dict):
            raise BadConfigError(f"{path}: expected a JSON object")
        return replace(from_hf_config(data, path.parent.name or path.stem), **_origin(path))
    known = known_models()
    key = name_or_path.lower()
    if key not in known and "/" in key:
        key = by_hub_id(key) or key
    if key not in known:
        raise UnknownModelError(name_or_path, known, difflib.get_close_matches(key, known, n=3, cutoff=0.5))
    file = deploy_dir() / "models" / f"{key}.yaml"
    try:
        return _spec_from_file(_ModelFile.model_validate(read_data(file)))
    except ValidationError as e:
        raise BadConfigError(pydantic_problems(file, e)) from None
