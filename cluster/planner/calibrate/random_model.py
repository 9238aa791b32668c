"""`random:<name>` models: a `deploy/models/<name>.yaml` shape with random weights made on the device.

A GPU machine without model files can still run pdserve's own engine at a real model's shapes (an 8B
model's 16 GB of weights are generated where they live, never written to disk):

    llm = random_llm("random:llama-3-8b", tmp_dir, device="cuda", dtype="bfloat16", num_pages=..., ...)

Pieces: `random_model_dir(name, out)` writes config.json, a one-tensor placeholder safetensors file (the
loader wants a file) and a word-level tokenizer, and returns the weight shapes the config implies (Qwen3,
Qwen3-MoE and Mixtral entries as their own architectures, experts as fused tensors; others Llama-shaped);
`RandomWeights` is a mapping the engine's `LlamaForward` reads like a state dict, making each tensor on
request (norms 1, the rest N(0, 0.02), seeded); `random_llm` builds an `engine.LLM` over both by swapping
`engine.llm.load_weights` for the duration of the constructor (the engine has no weights hook yet).
Who uses it: `pdserve profile --model random:NAME` (`profiler.py`), bench/gpu/step_power.py,
bench/gpu/decode_floor.py. Imports torch and the engine lazily (`model_shapes` and `random_model_dir`'s
config part are pure).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cluster.planner.errors import BadConfigError
from cluster.planner.inputs.paths import deploy_dir, read_data

PREFIX = "random:"


class EngineHookError(RuntimeError):
    """The engine no longer exposes the weight loader `random_llm` swaps (`engine.llm.load_weights`)."""


def is_random(model: str) -> bool:
    return model.startswith(PREFIX)


def model_entry(name: str) -> dict[str, Any]:
    """deploy/models/<name>.yaml as a dict; `BadConfigError` listing the known names otherwise."""
    path = deploy_dir() / "models" / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in (deploy_dir() / "models").glob("*.yaml"))
        raise BadConfigError(f"{PREFIX}{name}: no {path}; known: {', '.join(known)} (Qwen3, Qwen3-MoE and "
                             f"Mixtral run as themselves, the others as LlamaForCausalLM of their shape)")
    return read_data(path)


# the architectures a deploy/models entry may name that the engine runs from random weights: their model_type
# and whether heads carry Qwen3's q/k RMSNorm; any other (Llama-shaped: Mistral, Qwen2.5, OPT, ...) runs as Llama
ARCHITECTURES = {"Qwen3ForCausalLM": ("qwen3", True), "Qwen3MoeForCausalLM": ("qwen3_moe", True),
                 "MixtralForCausalLM": ("mixtral", False)}


def _arch(m: dict[str, Any]) -> tuple[str, bool]:
    return ARCHITECTURES.get(m.get("architecture", ""), ("llama", False))


def hf_config(m: dict[str, Any]) -> dict[str, Any]:
    """A config.json for a deploy/models entry: Qwen3, Qwen3-MoE and Mixtral as themselves (every layer sparse
    where the entry has `experts`), the rest as LlamaForCausalLM."""
    model_type, _ = _arch(m)
    arch = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
            "mixtral": "MixtralForCausalLM"}[model_type]
    cfg = {"architectures": [arch], "model_type": model_type, "hidden_size": m["hidden"],
           "intermediate_size": m["ffn"], "num_hidden_layers": m["layers"], "num_attention_heads": m["heads"],
           "num_key_value_heads": m["kv_heads"], "head_dim": m["head_dim"], "vocab_size": m["vocab"],
           "max_position_embeddings": m["max_positions"], "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
           "tie_word_embeddings": bool(m["tied_embeddings"]), "bos_token_id": 1, "eos_token_id": 2}
    if model_type == "qwen3_moe":
        cfg.update(num_experts=m["experts"], num_experts_per_tok=m["experts_per_token"],
                   moe_intermediate_size=m["expert_ffn"], norm_topk_prob=True, decoder_sparse_step=1,
                   mlp_only_layers=[])
    elif model_type == "mixtral":
        cfg.update(num_local_experts=m["experts"], num_experts_per_tok=m["experts_per_token"],
                   intermediate_size=m["expert_ffn"])
    return cfg


def model_shapes(m: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every weight's shape, by its Hugging Face name, for a deploy/models entry (MoE experts as the fused
    [E, 2I, H] / [E, H, I] tensors transformers 5 writes: one tensor a layer to make, not 3E)."""
    h, hd = m["hidden"], m["head_dim"]
    model_type, qk_norm = _arch(m)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (m["vocab"], h), "model.norm.weight": (h,)}
    if not m["tied_embeddings"]:
        shapes["lm_head.weight"] = (m["vocab"], h)
    for i in range(m["layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (m["heads"] * hd, h),
                       p + "self_attn.k_proj.weight": (m["kv_heads"] * hd, h),
                       p + "self_attn.v_proj.weight": (m["kv_heads"] * hd, h),
                       p + "self_attn.o_proj.weight": (h, m["heads"] * hd)})
        if qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
        if model_type in ("qwen3_moe", "mixtral"):
            e, f = m["experts"], m["expert_ffn"]
            shapes.update({p + "mlp.gate.weight": (e, h), p + "mlp.experts.gate_up_proj": (e, 2 * f, h),
                           p + "mlp.experts.down_proj": (e, h, f)})
        else:
            shapes.update({p + "mlp.gate_proj.weight": (m["ffn"], h), p + "mlp.up_proj.weight": (m["ffn"], h),
                           p + "mlp.down_proj.weight": (h, m["ffn"])})
    return shapes


def write_tokenizer(out: Path, vocab_size: int) -> None:
    """A word-level tokenizer over the words t0 .. t{vocab-1} ("t2" is EOS), so `LLM` can load the dir
    (the same tokenizer as tests/tiny_models.write_tiny_tokenizer; the product does not import tests/)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t2", "bos_token": "t1"}))


def random_model_dir(name: str | dict[str, Any], out: Path) -> tuple[Path, dict[str, tuple[int, ...]]]:
    """config.json, a placeholder weights file and a tokenizer for deploy/models/<name>.yaml (or an entry
    given as a dict) in `out`; returns the directory and the weight shapes it implies."""
    import torch
    from safetensors.torch import save_file

    m = model_entry(name) if isinstance(name, str) else name
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(m)))
    save_file({"placeholder": torch.zeros(1)}, str(out / "model.safetensors"))  # the loader wants one file
    write_tokenizer(out, m["vocab"])
    return out, model_shapes(m)


class RandomWeights:
    """A mapping that makes each weight the engine asks for on `device`, at random (nothing kept here)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], device: str, dtype):
        import torch

        self.shapes, self.device, self.dtype = shapes, device, dtype
        self.gen = torch.Generator(device=device).manual_seed(0)

    def __contains__(self, name: str) -> bool:
        return name in self.shapes

    def __getitem__(self, name: str):
        import torch

        shape = self.shapes[name]
        if name.endswith("norm.weight"):
            return torch.ones(shape, device=self.device, dtype=self.dtype)
        t = torch.empty(shape, device=self.device, dtype=self.dtype)
        return t.normal_(0.0, 0.02, generator=self.gen)


def random_llm(model: str | dict[str, Any], tmp: Path, device: str = "cpu", dtype: str = "bfloat16", **llm_kwargs):
    """An `engine.LLM` of `random:<name>` (or a deploy/models-shaped dict) with random weights on `device`;
    `tmp` holds its config and tokenizer while the engine lives."""
    import torch

    import engine.llm as engine_llm

    if isinstance(model, str):
        model = model[len(PREFIX):] if is_random(model) else model
    model_dir, shapes = random_model_dir(model, Path(tmp) / "model")
    real = getattr(engine_llm, "load_weights", None)
    if real is None:
        raise EngineHookError("engine.llm.load_weights is gone: random:<name> models need the engine's weight "
                              "loader hook (update cluster/planner/random_model.random_llm)")
    engine_llm.load_weights = lambda _dir: RandomWeights(shapes, device, getattr(torch, dtype))
    try:
        return engine_llm.LLM(model=str(model_dir), device=device, dtype=dtype, **llm_kwargs)
    finally:
        engine_llm.load_weights = real
