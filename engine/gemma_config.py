"""What a Gemma 3 text config (`gemma3_text`, `Gemma3ForCausalLM`) asks of the forward, read and checked.

Called by `engine.config` (`ModelConfig.from_hf_dict`, `unsupported_features`, `check_supported`) for
model_type "gemma3_text"; the forward that computes it is `engine.gemma`. Reads both config spellings:
transformers 5's (`rope_parameters` per layer type, `layer_types`) and the Hub's older one (`rope_theta`,
`rope_local_base_freq`, `rope_scaling` for the global layers, `sliding_window_pattern`), with
transformers' own defaults (`Gemma3TextConfig`) for keys a config leaves out.

Refused by name (`unsupported`): a RoPE type `engine.rope` does not build (per layer type), an activation
other than gelu_pytorch_tanh, attention-logit soft-capping (Gemma 2's; no Gemma 3 checkpoint sets it and
the forward's SDPA / paged kernels have no tanh on the scores), bidirectional attention, q/k/v/o biases.
The multimodal checkpoint (`gemma3`, Gemma3ForConditionalGeneration: google/gemma-3-4b/12b/27b-it) is served
as its language model: `text_part` reads its `text_config` as a gemma3_text config, `text_weight_name` maps
its `language_model.*` tensors to the text model's names and leaves the vision tower unread (the engine
takes token ids only: no images).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ROPE_TYPES = ("default", "linear", "llama3")  # engine.rope's (engine.config.ROPE_TYPES)
ACTIVATION = "gelu_pytorch_tanh"
GLOBAL_THETA, LOCAL_THETA = 1_000_000.0, 10_000.0  # transformers' Gemma3TextConfig.default_theta
MULTIMODAL = ("a multimodal Gemma 3 config (model_type gemma3) without a text_config: pdserve serves the text "
              "model of one that has it, or a text-only Gemma3ForCausalLM checkpoint (model_type gemma3_text)")
# transformers' Gemma3TextConfig defaults (the same in 4.50 and 5.x): the Hub's multimodal configs (google/
# gemma-3-4b-it, -12b-it, -27b-it) write only what differs from them in their text_config
TEXT_DEFAULTS = dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                     num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_activation=ACTIVATION,
                     max_position_embeddings=131_072, rms_norm_eps=1e-6, eos_token_id=1, bos_token_id=2,
                     query_pre_attn_scalar=256, sliding_window=4096)
# checkpoint name prefixes of the multimodal model's language model -> the text model's (the Hub's layout, then
# transformers 5's own); the vision tower and projector are not read
TEXT_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                 ("model.language_model.", "model."))
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def text_part(d: dict[str, Any]) -> dict[str, Any]:
    """A multimodal Gemma 3 config.json (model_type gemma3, Gemma3ForConditionalGeneration) as the config of
    its language model: `text_config` over transformers' defaults, as a gemma3_text config; the LM head tied as
    the outer config says (default true), its eos/bos ids where it names them. Other configs unchanged."""
    if d.get("model_type") != "gemma3" or not isinstance(d.get("text_config"), dict):
        return d
    t = {**TEXT_DEFAULTS, **d["text_config"], "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"]}
    t["tie_word_embeddings"] = d.get("tie_word_embeddings", True)
    for key in ("eos_token_id", "bos_token_id"):
        if d.get(key) is not None:
            t[key] = d[key]
    return t


def text_weight_name(name: str) -> str | None:
    """The name the text forward reads a checkpoint tensor under (a multimodal checkpoint's language model
    renamed, its vision tower and projector None); other names unchanged."""
    for old, new in TEXT_PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return None if name.startswith(VISION_PREFIXES) else name


def layer_types(d: dict[str, Any]) -> list[str]:
    """Each layer's attention, "sliding_attention" or "full_attention": `layer_types`, else one global
    layer every `sliding_window_pattern` (default 6), as transformers fills it in."""
    kinds = d.get("layer_types")
    if kinds:
        return list(kinds)
    pattern = d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(d["num_hidden_layers"])]


def _rope(d: dict[str, Any], kind: str) -> dict[str, Any]:
    params = d.get("rope_parameters") or {}
    if kind in params:  # transformers 5: one dict per layer type
        rope = dict(params[kind] or {})
    elif kind == "full_attention":  # the Hub's older spelling: rope_scaling applies to the global layers
        rope = dict(d.get("rope_scaling") or (params if "rope_type" in params else {}))
        rope.setdefault("rope_theta", d.get("rope_theta", GLOBAL_THETA))
    else:
        rope = {"rope_theta": d.get("rope_local_base_freq", LOCAL_THETA)}
    rope.setdefault("rope_theta", GLOBAL_THETA if kind == "full_attention" else LOCAL_THETA)
    rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    return rope


def global_rope(d: dict[str, Any]) -> dict[str, Any]:
    return _rope(d, "full_attention")


def unsupported(d: dict[str, Any]) -> list[str]:
    """Each feature Gemma 3 text config `d` asks for that `engine.gemma` does not compute."""
    out = []
    for kind in ("full_attention", "sliding_attention"):
        rope = _rope(d, kind)["rope_type"]
        if rope not in ROPE_TYPES:
            out.append(f"rope_type={rope} for {kind} layers (supported: {', '.join(ROPE_TYPES)})")
    act = d.get("hidden_activation") or d.get("hidden_act") or ACTIVATION
    if act != ACTIVATION:
        out.append(f"hidden_activation={act} (supported: {ACTIVATION})")
    if d.get("attn_logit_softcapping") is not None:
        out.append(f"attn_logit_softcapping={d['attn_logit_softcapping']} (attention-score soft-capping)")
    if d.get("use_bidirectional_attention"):
        out.append("use_bidirectional_attention=true")
    if d.get("attention_bias"):
        out.append("attention_bias=true (q/k/v/o biases)")
    kinds = set(layer_types(d))
    if not kinds <= {"sliding_attention", "full_attention"}:
        out.append(f"layer_types {sorted(kinds - {'sliding_attention', 'full_attention'})}")
    return out


@dataclass(frozen=True)
class GemmaConfig:
    """The parts of Gemma 3's forward a Llama layer lacks (`engine.gemma`): attention scaled by
    query_pre_attn_scalar ** -0.5, local layers that see the last `sliding_window` positions with their
    own RoPE, and tanh soft-capping of the final logits."""
    query_pre_attn_scalar: float
    sliding_window: int | None  # tokens a local layer attends to (None: every layer global)
    local_layers: tuple[int, ...]  # the "sliding_attention" layers
    local_rope: dict[str, Any]  # their RoPE (rope_local_base_freq); ModelConfig.rope is the global layers'
    final_logit_softcapping: float | None

    @staticmethod
    def from_hf_dict(d: dict[str, Any]) -> "GemmaConfig":
        window = d.get("sliding_window", 4096)
        local = tuple(i for i, k in enumerate(layer_types(d)) if k == "sliding_attention") if window else ()
        return GemmaConfig(float(d.get("query_pre_attn_scalar", 256)), window if local else None, local,
                           _rope(d, "sliding_attention"), d.get("final_logit_softcapping"))
