"""Tiny random Gemma 3 text checkpoints (`Gemma3ForCausalLM`) written with transformers' own classes.

Shapes: hidden 64, 6 layers (5 local : 1 global, as the real configs; `layer_types` overrides), 4 query / 2 KV
heads of 32 dims, an untied LM head (tied, these tiny models mostly repeat one token), query_pre_attn_scalar
24 (not head_dim: a wrong scale shows), sliding window 8 so the prompts of the tests cross it, global RoPE
linear-scaled (factor 4, theta 1e6) and local RoPE theta 10k, the tiny word-level tokenizer's 256 words.
Norm weights (Gemma's (1 + w): transformers initialises w at 0) are drawn around 0 with spread 0.3, so a
skipped or swapped norm shows; `write_tiny_gemma(out, shard=...)` saves safetensors (sharded with an index
when `shard` names a size).
"""
from __future__ import annotations

from pathlib import Path

import torch

from tests.exactness import hf_generate_greedy
from tests.tiny_models import TINY, write_tiny_tokenizer

WINDOW = 8
GEMMA = dict(TINY, num_hidden_layers=6, head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW,
             rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                              "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}},
             initializer_range=0.1, final_logit_softcapping=None, tie_word_embeddings=False)
GEMMA.pop("rms_norm_eps")  # Gemma's default (1e-6)


def hf_gemma_config(**overrides):
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**{**GEMMA, **overrides})


def write_tiny_gemma(out: Path, seed: int = 0, shard: str | None = None, **overrides) -> Path:
    """A random-weight Gemma 3 text model saved as a safetensors directory (with a tokenizer); returns it."""
    from transformers import Gemma3ForCausalLM

    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(hf_gemma_config(**overrides)).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(out, **kw)
    write_tiny_tokenizer(Path(out), model.config.vocab_size)
    return Path(out)


def write_tiny_gemma_multimodal(out: Path, seed: int = 0, original_format: bool = True, **overrides) -> Path:
    """The same language model inside transformers' multimodal Gemma3ForConditionalGeneration (a one-layer
    SigLIP tower of width 16, image tokens 250-252), saved as the Hub's checkpoints are (`language_model.*`,
    `vision_tower.*`, `multi_modal_projector.*`; `original_format=False`: transformers 5's `model.language_model.*`)
    with a top-level config whose `text_config` holds the text model's; LM head tied (the outer config's default)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    cfg = Gemma3Config(text_config=hf_gemma_config(**overrides).to_dict(), vision_config=vision.to_dict(),
                       mm_tokens_per_image=4, boi_token_index=250, eoi_token_index=251, image_token_index=252)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(cfg).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
    model.save_pretrained(out, save_original_format=original_format)
    write_tiny_tokenizer(Path(out), cfg.text_config.vocab_size)
    return Path(out)


def hf_gemma_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int, attn: str = "sdpa"
                    ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """transformers' own greedy generate() in float32 (the text model, or the multimodal one on text-only
    prompts), one prompt at a time: each prompt's new tokens and the logits that chose them."""
    import json

    from transformers import Gemma3ForCausalLM, Gemma3ForConditionalGeneration

    multimodal = json.loads((Path(model_dir) / "config.json").read_text())["model_type"] == "gemma3"
    cls = Gemma3ForConditionalGeneration if multimodal else Gemma3ForCausalLM
    model = cls.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn).eval()
    return hf_generate_greedy(model, prompts, max_new_tokens)
