"""Model configs as data: `ModelSpec` (frozen) from `deploy/models/<short-name>.yaml` or an HF config.json.

`load_model("llama-3-8b")` reads the YAML (validated by a pydantic edge model that rejects unknown keys);
so does the model's Hugging Face Hub id (`meta-llama/Meta-Llama-3-8B`, the file's `hf_id`);
`load_model("path/config.json")` (or a model directory holding one) maps the Hugging Face keys of
Llama/Mistral/Qwen2/Qwen3, Qwen3-MoE/Mixtral, Gemma 3 (its `text_config`) and OPT configs. The latency models
(`roofline`, `gpu_latency`, `moe`) and the memory model (`search/configs.py`) read the shape from here:
parameters per layer, KV bytes per token. `hf_id`, `architecture` and `local_dir` say what a planned spec's
`model:` names (`spec_writer.spec_model`).

Mixture of experts (`experts` > 0; 0: dense, the default): `moe_layers` of the layers (default all) replace the
dense MLP by a router over `experts` gated experts of width `expert_ffn`, `experts_per_token` of them per token,
plus a shared expert of width `shared_expert_ffn` on every token where the model has one. `params` stays the
total (every expert: what memory holds); `active_params` is what one token computes with.
Sliding windows (Gemma 3): `local_layers` of the layers attend to the last `sliding_window` tokens only. The
shape carries them; the step model and the KV accounting do not use them yet (every layer is priced and sized
as a global one: conservative for contexts past the window).
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

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
    experts: int = 0  # routed experts per MoE layer; 0: a dense model
    experts_per_token: int = 0  # top-k
    expert_ffn: int = 0  # one expert's intermediate size (gated: 3 matrices)
    shared_expert_ffn: int = 0  # an expert every token runs besides its top-k (0: none)
    moe_layers: int = 0  # layers whose MLP is a mixture of experts (the rest keep the dense `ffn`)
    sliding_window: int | None = None  # tokens a local layer attends to (Gemma 3)
    local_layers: int = 0  # layers attending to the sliding window only (not used by the step model yet)

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def attention_params(self) -> int:
        """q, k, v and o projections of one layer."""
        q_out = self.heads * self.head_dim
        kv_out = self.kv_heads * self.head_dim
        return self.hidden * q_out + 2 * self.hidden * kv_out + q_out * self.hidden

    @property
    def dense_mlp_params(self) -> int:
        return (3 if self.gated_mlp else 2) * self.hidden * self.ffn

    @property
    def expert_params(self) -> int:
        """One routed expert's weights (gate, up, down)."""
        return 3 * self.hidden * self.expert_ffn

    @property
    def moe_fixed_params(self) -> int:
        """What every token of an MoE layer reads besides its experts: the router and the shared expert."""
        return self.hidden * self.experts + 3 * self.hidden * self.shared_expert_ffn

    @property
    def layer_params(self) -> float:
        """Weights of one decoder layer that every token computes with (MoE: the mean over layers of the
        active ones: attention, router, shared expert and top-k experts)."""
        if not self.is_moe:
            return self.attention_params + self.dense_mlp_params
        active = self.moe_fixed_params + self.experts_per_token * self.expert_params
        dense = self.layers - self.moe_layers
        return self.attention_params + (dense * self.dense_mlp_params + self.moe_layers * active) / self.layers

    @property
    def all_layers_params(self) -> int:
        """Every decoder layer's weights, every expert counted."""
        if not self.is_moe:
            return self.layers * (self.attention_params + self.dense_mlp_params)
        return (self.layers * self.attention_params + (self.layers - self.moe_layers) * self.dense_mlp_params
                + self.moe_layers * (self.moe_fixed_params + self.experts * self.expert_params))

    @property
    def expert_weight_params(self) -> int:
        """The routed experts' weights over all MoE layers (what expert parallelism shards)."""
        return self.moe_layers * self.experts * self.expert_params

    @property
    def embedding_params(self) -> int:
        embed = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return embed + (self.max_positions * self.hidden if self.learned_positions else 0)

    @property
    def counted_params(self) -> int:
        return self.all_layers_params + self.embedding_params

    @property
    def active_params(self) -> float:
        """Parameters one token computes with (embeddings and LM head included, as vendors count them)."""
        if not self.is_moe:
            return float(self.params)
        return self.layers * self.layer_params + self.embedding_params

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
    experts: int = Field(0, ge=0)  # mixture of experts: routed experts per MoE layer (0: dense)
    experts_per_token: int | None = Field(None, ge=1)
    expert_ffn: int | None = Field(None, ge=1)
    shared_expert_ffn: int = Field(0, ge=0)
    moe_layers: int | None = Field(None, ge=1)  # None: every layer (with experts)
    sliding_window: int | None = Field(None, ge=1)
    local_layers: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _moe_and_windows(self) -> "_ModelFile":
        if self.experts == 0:
            extra = [k for k in ("experts_per_token", "expert_ffn", "moe_layers") if getattr(self, k) is not None]
            extra += ["shared_expert_ffn"] if self.shared_expert_ffn else []
            if extra:
                raise ValueError(f"{', '.join(extra)} set on a dense model: give experts (> 0) too")
        else:
            if self.experts_per_token is None or self.expert_ffn is None:
                raise ValueError("a mixture of experts needs experts_per_token and expert_ffn")
            if self.experts_per_token > self.experts:
                raise ValueError(f"experts_per_token {self.experts_per_token} exceeds experts {self.experts}")
            if not self.gated_mlp:
                raise ValueError("experts are gated (SwiGLU) MLPs: gated_mlp must be true with experts")
            if (self.moe_layers or 0) > self.layers:
                raise ValueError(f"moe_layers {self.moe_layers} exceeds layers {self.layers}")
        if self.local_layers > self.layers:
            raise ValueError(f"local_layers {self.local_layers} exceeds layers {self.layers}")
        if self.local_layers and self.sliding_window is None:
            raise ValueError("local_layers needs sliding_window (the tokens a local layer attends to)")
        return self


def known_models() -> list[str]:
    return sorted(p.stem for p in (deploy_dir() / "models").glob("*.yaml"))


def _spec_from_file(m: _ModelFile) -> ModelSpec:
    learned = (not m.gated_mlp) if m.learned_positions is None else m.learned_positions
    moe = dict(experts=m.experts, experts_per_token=m.experts_per_token or 0, expert_ffn=m.expert_ffn or 0,
               shared_expert_ffn=m.shared_expert_ffn, moe_layers=(m.moe_layers or m.layers) if m.experts else 0)
    spec = ModelSpec(m.name, m.layers, m.hidden, m.heads, m.kv_heads, m.head_dim, m.ffn, m.vocab,
                     m.max_positions, 0.0, m.gated_mlp, m.tied_embeddings, learned, m.hf_id, m.architecture or "",
                     sliding_window=m.sliding_window, local_layers=m.local_layers, **moe)
    return _with_params(spec, m.params)


def _with_params(spec: ModelSpec, params: float | None) -> ModelSpec:
    from dataclasses import replace
    return replace(spec, params=float(params or spec.counted_params))


def _hf_moe(d: dict[str, Any], layers: int) -> dict[str, Any]:
    """The MoE fields of a Qwen3-MoE / Qwen2-MoE / Mixtral config.json (the keys engine/config.py reads)."""
    experts = d.get("num_local_experts", d.get("num_experts")) or 0
    if not experts:
        return {}
    mixtral = d.get("model_type") == "mixtral"
    step, only = d.get("decoder_sparse_step", 1) or 1, set(d.get("mlp_only_layers") or ())
    sparse = sum(1 for i in range(layers) if i not in only and (i + 1) % step == 0)
    width = d["intermediate_size"] if mixtral else d.get("moe_intermediate_size", d["intermediate_size"])
    return dict(experts=experts, experts_per_token=d.get("num_experts_per_tok", 2), expert_ffn=width,
                shared_expert_ffn=d.get("shared_expert_intermediate_size") or 0, moe_layers=sparse)


def _hf_windows(d: dict[str, Any], layers: int) -> dict[str, Any]:
    """Gemma 3's local layers: `layer_types`, else one global layer every `sliding_window_pattern`."""
    window = d.get("sliding_window")
    if not window or d.get("use_sliding_window") is False:
        return {}
    kinds = d.get("layer_types")
    pattern = d.get("sliding_window_pattern") or d.get("_sliding_window_pattern")
    if kinds:
        local = sum(1 for k in kinds if k == "sliding_attention")
    elif pattern:
        local = sum(1 for i in range(layers) if (i + 1) % pattern)
    else:
        local = layers  # Mistral-style: every layer windowed
    return dict(sliding_window=window, local_layers=local)


def from_hf_config(d: dict[str, Any], name: str) -> ModelSpec:
    """Map a Hugging Face config.json (Llama/Mistral/Qwen2/Qwen3, Qwen3-MoE/Mixtral, Gemma 3's
    `text_config`, or OPT keys) to a `ModelSpec`."""
    if isinstance(d.get("text_config"), dict):  # multimodal wrappers (Gemma 3): the language model's shape
        d = {**d["text_config"], "architectures": d.get("architectures")}
    try:
        heads = d["num_attention_heads"]
        hidden = d["hidden_size"]
        is_opt = d.get("model_type") == "opt"
        ffn = d["ffn_dim"] if is_opt else d["intermediate_size"]
        archs = d.get("architectures") or [""]
        tied = d.get("tie_word_embeddings", is_opt or str(d.get("model_type", "")).startswith("gemma"))
        spec = ModelSpec(
            name=name, layers=d["num_hidden_layers"], hidden=hidden, heads=heads,
            kv_heads=d.get("num_key_value_heads") or heads, head_dim=d.get("head_dim") or hidden // heads,
            ffn=ffn, vocab=d["vocab_size"], max_positions=d.get("max_position_embeddings", 2048), params=0.0,
            gated_mlp=not is_opt, tied_embeddings=tied, learned_positions=is_opt,
            architecture=str(archs[0]), **_hf_moe(d, d["num_hidden_layers"]),
            **_hf_windows(d, d["num_hidden_layers"]))
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
