"""`build_forward`: the forward class a model config runs, built where a model is loaded (`LLM`, the
tensor-parallel rank and pipeline stage workers): `engine.gemma.GemmaForward` for Gemma 3 text configs,
`engine.model.LlamaForward` for every other supported architecture. Same arguments, same contract."""
from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.model import LlamaForward


def build_forward(cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype, device="cpu",
                  **kw) -> LlamaForward:
    """kw: `all_reduce` (a tensor-parallel rank), `layers` (a pipeline stage's slice)."""
    if cfg.gemma is not None:
        from engine.gemma import GemmaForward

        return GemmaForward(cfg, weights, dtype, device, **kw)
    return LlamaForward(cfg, weights, dtype, device, **kw)
