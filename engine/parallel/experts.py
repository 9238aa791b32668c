"""Expert parallelism: which experts a rank holds and which checkpoint tensors it reads (pure functions).

Called by `expert_worker.ExpertWorker` (what to read) and by the driver's `EPRunner` (validation). The
experts of every MoE layer are split into `size` contiguous blocks, rank r holding global ids
[r * E / size, (r + 1) * E / size): a rank's block is one slice of transformers 5's fused [E, ...] tensors,
and a rank sums its share of a token's experts in ascending order, as one process does. Everything else
(embedding, attention, norms, the router, dense MLP layers, Qwen2-MoE's shared expert, the LM head) is whole
on every rank: the shared expert's `mlp.shared_expert.*` names match neither pattern below.
"""
from __future__ import annotations

import re

from engine.config import ModelConfig
from engine.parallel.validate import EP_FIELD as FIELD, validate_ep  # noqa: F401 - judged with TP/PP there

_PER_EXPERT = re.compile(r"\.experts\.(\d+)\.")  # mlp.experts.3.gate_proj.weight, block_sparse_moe.experts.3.w1.weight
_FUSED = (".experts.gate_up_proj", ".experts.down_proj")  # transformers 5's [E, ...] tensors (no ".weight")


def expert_range(num_experts: int, rank: int, size: int) -> range:
    """Global expert ids rank `rank` of `size` holds (every MoE layer alike)."""
    per = num_experts // size
    return range(rank * per, (rank + 1) * per)


def expert_slice(name: str, experts: range) -> range | bool:
    """What a rank holding `experts` reads of checkpoint tensor `name`: True (whole), False (another rank's
    expert), or the rows (dim 0) of a fused expert tensor."""
    m = _PER_EXPERT.search(name)
    if m is not None:
        return int(m.group(1)) in experts
    if name.endswith(_FUSED):
        return experts
    return True


def rank_experts(cfg: ModelConfig, rank: int, size: int) -> range:
    validate_ep(cfg, size)
    assert cfg.moe is not None
    return expert_range(cfg.moe.num_experts, rank, size)
