"""Tiny random Qwen3, Qwen2-MoE, Qwen3-MoE and Mixtral checkpoints written with transformers' own classes.

Shapes follow `tests.tiny_models.TINY` (hidden 64, 2 layers, 4 query / 2 KV heads of 16 dims); experts are
8 of 32 dims (Qwen2-MoE's shared expert 48, its q/k/v biases drawn, not left at 0).
`write_tiny_moe(arch, out, shard=...)` saves safetensors (sharded with an index when `shard` names a size such
as "150KB"; `original_format=False` keeps transformers 5's fused 3-D expert tensors) and the word-level tokenizer
of `tests.tiny_models`. Norm weights (RMSNorm, Qwen3's q/k norms) are drawn around 1 instead of left at 1, so a
forward that skipped or swapped one would show it.
"""
from __future__ import annotations

from pathlib import Path

import torch

from tests.exactness import hf_generate_greedy
from tests.tiny_models import TINY, write_tiny_tokenizer

INIT_RANGE = 0.1
ATTN = dict(head_dim=16, initializer_range=INIT_RANGE)
MOE = {  # arch -> config fields beyond TINY
    "qwen3": dict(ATTN, tie_word_embeddings=False),
    "qwen3_moe": dict(ATTN, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True,
                      tie_word_embeddings=False),
    "qwen2_moe": dict(ATTN, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, norm_topk_prob=False, tie_word_embeddings=False),
    "mixtral": dict(ATTN, num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, tie_word_embeddings=False),
}


def hf_moe_config(arch: str, **overrides):
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig

    cls = {"qwen3": Qwen3Config, "qwen2_moe": Qwen2MoeConfig, "qwen3_moe": Qwen3MoeConfig,
           "mixtral": MixtralConfig}[arch]
    return cls(**{**TINY, **MOE[arch], **overrides})


def write_tiny_moe(arch: str, out: Path, seed: int = 0, shard: str | None = None, original_format: bool = True,
                   **overrides) -> Path:
    """A random-weight `arch` model saved as a safetensors directory (with a tokenizer); returns it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_moe_config(arch, **overrides), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.2)
            elif name.endswith("bias"):  # Qwen2-MoE's q/k/v (the others have none): zero would hide them
                p.normal_(0, 0.5)
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(out, save_original_format=original_format, **kw)
    write_tiny_tokenizer(Path(out), model.config.vocab_size)
    return Path(out)


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int
              ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """transformers' own greedy generate() in float32 (eager experts, sdpa attention), one prompt at a time:
    each prompt's new tokens and the logits that chose them."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa",
                                                 experts_implementation="eager").eval()
    return hf_generate_greedy(model, prompts, max_new_tokens)
