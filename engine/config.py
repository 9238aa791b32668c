"""`ModelConfig`: the frozen subset of a Hugging Face config the engine's forward needs.

Read once by `engine.loader` from `config.json`; the model, the KV page spec and the tokenizer limits all
come from here. Architectures outside `SUPPORTED` raise `UnsupportedArchitectureError` naming them and
listing what runs (`check_supported`, also used on a Hub config before any weight is downloaded).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.errors import UnsupportedArchitectureError

# model_type -> whether q/k/v projections carry a bias by default
SUPPORTED = {"llama": False, "mistral": False, "qwen2": True}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def supported_architectures() -> tuple[str, ...]:
    return tuple(f"{ARCHITECTURES[mt]} ({mt})" for mt in SUPPORTED)


def check_supported(d: dict[str, Any], model: str | None = None) -> None:
    """UnsupportedArchitectureError unless config.json `d` is of a model type the engine runs."""
    mt = d.get("model_type", "?")
    if mt not in SUPPORTED:
        archs = d.get("architectures") or []
        arch = f"{archs[0]} ({mt})" if archs and isinstance(archs[0], str) else mt
        raise UnsupportedArchitectureError(arch, supported_architectures(), model)


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool
    rope: dict[str, Any] = field(default_factory=dict)  # rope_type, rope_theta and scaling keys
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    @staticmethod
    def from_hf_dict(d: dict[str, Any]) -> "ModelConfig":
        check_supported(d)
        mt = d["model_type"]
        heads = d["num_attention_heads"]
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        rope.setdefault("rope_theta", d.get("rope_theta", rope.get("rope_theta", 10000.0)))
        rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        window = d.get("sliding_window")
        if mt == "qwen2" and not d.get("use_sliding_window", False):
            window = None
        return ModelConfig(
            model_type=mt,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            max_position=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            qkv_bias=d.get("attention_bias", SUPPORTED[mt]) or SUPPORTED[mt],
            rope=rope,
            sliding_window=window,
            eos_token_ids=eos_ids,
            bos_token_id=d.get("bos_token_id"),
        )
