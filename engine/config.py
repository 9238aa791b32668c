"""`ModelConfig`: the frozen subset of a Hugging Face config the engine's forward needs.

Read once by `engine.loader` from `config.json`; the model, the KV page spec and the tokenizer limits all
come from here. Architectures outside `SUPPORTED` raise `UnsupportedArchitectureError` naming them and
listing what runs (`check_supported`, also used on a Hub config before any weight is downloaded); so does a
supported architecture whose config asks for a feature the forward lacks (`unsupported_features`: a RoPE
type, an activation, an output-projection bias, sliding windows on some layers only, shared experts outside
Qwen2-MoE), so a checkpoint is refused instead of served with wrong tokens. Mixture-of-experts configs
(Qwen2-MoE, Qwen3-MoE, Mixtral) carry a `MoEConfig` (Qwen2-MoE's with its gated shared expert's width); the
forward's MoE layers are `engine.moe`. Gemma 3 text configs carry a `GemmaConfig`
(its attention scale, logit soft-capping, local layers and their RoPE; read and checked by `engine.gemma_config`);
the forward is `engine.gemma`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine import gemma_config
from engine.errors import UnsupportedArchitectureError, UnsupportedFeatureError
from engine.gemma_config import GemmaConfig

# model_type -> whether q/k/v projections carry a bias by default
SUPPORTED = {"llama": False, "mistral": False, "qwen2": True, "qwen3": False, "qwen2_moe": True, "qwen3_moe": False,
             "mixtral": False, "gemma3_text": False}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "mixtral": "MixtralForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
QK_NORM = ("qwen3", "qwen3_moe", "gemma3_text")  # RMSNorm over each query/key head's dims before RoPE
ROPE_TYPES = ("default", "linear", "llama3")  # what engine.rope builds (it raises on others too)
ACTIVATIONS = ("silu", "swish")  # SwiGLU's gate activation, the only one the forward computes


def supported_architectures() -> tuple[str, ...]:
    return tuple(f"{ARCHITECTURES[mt]} ({mt})" for mt in SUPPORTED)


def check_supported(d: dict[str, Any], model: str | None = None) -> None:
    """UnsupportedArchitectureError unless config.json `d` is of a model type the engine runs;
    UnsupportedFeatureError (a subclass) if it is, but asks for something the forward does not compute."""
    d = gemma_config.text_part(d)  # a multimodal Gemma 3 config: its language model's
    mt = d.get("model_type", "?")
    if mt == "gemma3":  # multimodal, without a text_config to serve
        raise UnsupportedFeatureError(_arch(d), [gemma_config.MULTIMODAL], model)
    if mt not in SUPPORTED:
        archs = d.get("architectures") or []
        arch = f"{archs[0]} ({mt})" if archs and isinstance(archs[0], str) else mt
        raise UnsupportedArchitectureError(arch, supported_architectures(), model)
    problems = unsupported_features(d)
    if problems:
        raise UnsupportedFeatureError(_arch(d), problems, model)


def _arch(d: dict[str, Any]) -> str:
    archs = d.get("architectures") or []
    return archs[0] if archs and isinstance(archs[0], str) else d.get("model_type", "?")


def _rope(d: dict[str, Any]) -> dict[str, Any]:
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    rope.setdefault("rope_theta", d.get("rope_theta", rope.get("rope_theta", 10000.0)))
    rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    return rope


def _window(d: dict[str, Any]) -> int | None:
    """The one sliding window every layer uses (None: full attention). Per-layer `layer_types` mixing
    sliding and full layers have no single window: `unsupported_features` names them."""
    window = d.get("sliding_window")
    if d["model_type"] in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not d.get("use_sliding_window", False):
        return None
    kinds = set(d.get("layer_types") or [])
    if kinds == {"full_attention"}:
        return None
    return window


def _qkv_bias(d: dict[str, Any]) -> bool:
    """Whether q/k/v carry a bias: Qwen2 always; Qwen2-MoE per its `qkv_bias` (default true; transformers
    reads no `attention_bias` there); the others per `attention_bias` (o_proj's too: refused above)."""
    mt = d["model_type"]
    if mt == "qwen2_moe":
        return bool(d.get("qkv_bias", True))
    return bool(d.get("attention_bias", SUPPORTED[mt]) or SUPPORTED[mt])


def unsupported_features(d: dict[str, Any]) -> list[str]:
    """Each feature config.json `d` (of a supported model type) asks for that the forward does not compute,
    named by its config key; empty when the engine serves it exactly."""
    if d["model_type"] == "gemma3_text":
        return gemma_config.unsupported(d)
    out = []
    rope = _rope(d)["rope_type"]
    if rope not in ROPE_TYPES:
        out.append(f"rope_type={rope} (supported: {', '.join(ROPE_TYPES)})")
    act = d.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        out.append(f"hidden_act={act} (supported: silu)")
    if d.get("attention_bias") and d["model_type"] not in ("qwen2", "qwen2_moe"):  # Qwen2's bias: q/k/v only
        out.append("attention_bias=true (o_proj bias)")
    kinds = set(d.get("layer_types") or [])
    if (d.get("use_sliding_window", True) and d.get("sliding_window") is not None
            and kinds and kinds != {"sliding_attention"} and kinds != {"full_attention"}):
        out.append("layer_types mixing sliding and full attention (per-layer sliding windows)")
    if d.get("shared_expert_intermediate_size") and d["model_type"] != "qwen2_moe":
        out.append("shared experts (shared_expert_intermediate_size; computed for Qwen2-MoE only)")
    if d.get("n_shared_experts"):  # DeepSeek's: beside MLA, grouped routing, ...; not Qwen2-MoE's gated one
        out.append("shared experts (n_shared_experts)")
    return out


@dataclass(frozen=True)
class MoEConfig:
    """The sparse MLP of Qwen2-MoE / Qwen3-MoE / Mixtral layers: a router picks `top_k` of `num_experts` SwiGLU
    experts per token (softmax over all experts in float32, then top-k; `norm_topk_prob` renormalises the k
    weights to sum to 1: Mixtral always, the Qwens as their config says). Qwen2-MoE adds a shared SwiGLU expert
    of `shared_intermediate_size` on every token, scaled by sigmoid(shared_expert_gate(h))."""
    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]  # layer ids with an MoE MLP; the others run the dense MLP
    weights_in_model_dtype: bool  # Qwen3-MoE casts the routing weights to the model dtype; Mixtral keeps float32
    naming: str  # checkpoint names: "qwen" (mlp.gate, experts.E.gate_proj/up_proj/down_proj) | "mixtral" (w1/w3/w2)
    shared_intermediate_size: int = 0  # Qwen2-MoE's shared expert (mlp.shared_expert.*); 0: none

    @staticmethod
    def from_hf_dict(d: dict[str, Any]) -> "MoEConfig | None":
        mt, layers = d["model_type"], d["num_hidden_layers"]
        # the expert count's key: Hub configs write num_experts (Qwen3-MoE) / num_local_experts (Mixtral);
        # transformers 5 saves both models' as num_local_experts (an attribute_map alias)
        experts = d["num_local_experts"] if "num_local_experts" in d else d.get("num_experts")
        if mt == "mixtral":
            return MoEConfig(experts or 8, d.get("num_experts_per_tok", 2), d["intermediate_size"],
                             True, tuple(range(layers)), False, "mixtral")
        if mt in ("qwen3_moe", "qwen2_moe"):  # the same layer choice and router; Qwen2-MoE's defaults differ
            qwen2 = mt == "qwen2_moe"
            experts = (60 if qwen2 else 128) if experts is None else experts
            step, only = d.get("decoder_sparse_step", 1) or 1, set(d.get("mlp_only_layers") or [])
            sparse = tuple(i for i in range(layers) if i not in only and experts > 0 and (i + 1) % step == 0)
            if not sparse:
                return None
            shared = d.get("shared_expert_intermediate_size", 5632) if qwen2 else 0
            return MoEConfig(experts, d.get("num_experts_per_tok", 4 if qwen2 else 8),
                             d.get("moe_intermediate_size", 1408 if qwen2 else 768),
                             bool(d.get("norm_topk_prob", False)), sparse, True, "qwen", shared or 0)
        return None


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
    qk_norm: bool = False  # Qwen3: per-head RMSNorm of q and k before RoPE
    moe: MoEConfig | None = None  # Qwen2-MoE, Qwen3-MoE, Mixtral: the layers whose MLP is a mixture of experts
    gemma: GemmaConfig | None = None  # Gemma 3 text: engine.gemma's forward (local layers, scale, soft-capping)

    @staticmethod
    def from_hf_dict(d: dict[str, Any]) -> "ModelConfig":
        d = gemma_config.text_part(d)  # a multimodal Gemma 3 config: its language model's
        check_supported(d)
        mt = d["model_type"]
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
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
            qkv_bias=_qkv_bias(d),
            rope=gemma_config.global_rope(d) if mt == "gemma3_text" else _rope(d),
            sliding_window=None if mt == "gemma3_text" else _window(d),
            eos_token_ids=eos_ids,
            bos_token_id=d.get("bos_token_id"),
            qk_norm=mt in QK_NORM,
            moe=MoEConfig.from_hf_dict(d),
            gemma=GemmaConfig.from_hf_dict(d) if mt == "gemma3_text" else None,
        )

    @property
    def local_window(self) -> int | None:
        """Tokens a local layer sees where some layers are local and the others global (Gemma 3); None
        otherwise (`sliding_window` is then every layer's window, or None)."""
        return self.gemma.sliding_window if self.gemma is not None and self.gemma.local_layers else None
