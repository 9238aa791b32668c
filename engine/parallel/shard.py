"""Tensor-parallel sharding: which heads a rank owns, and its slice of a full weight dict (pure functions).

Called by `rank_worker.RankWorker` (slice after loading) and by anyone validating a degree before launch
(`LLM`, the cluster spec). Megatron-style split of a Llama block over `size` ranks:
- column-parallel (rows of the weight sliced): q/k/v projections by heads, gate/up by intermediate rows;
- row-parallel (columns sliced): o by query heads, down by intermediate columns; their partial outputs are
  summed by an all-reduce in the forward (`LlamaForward(all_reduce=...)`);
- embedding, lm_head and norms stay whole on every rank.
Mixture-of-experts layers (Qwen3-MoE, Mixtral) split the same way inside every expert: gate/up (w1/w3) by rows of
the expert's intermediate width, down (w2) by its columns, so a rank's MoE output is a partial sum reduced by
the dense MLP's all-reduce; the router is whole (every rank routes every token identically). transformers 5's
fused [E, 2I, H] gate_up tensor is two slices of dim 1 (the rank's gate rows, then its up rows). Qwen2-MoE's
shared expert splits as a dense MLP of its own width (reduced with the experts' partial sum); its
shared_expert_gate ([1, hidden]) is whole on every rank.
Query heads are split evenly. KV heads are split evenly when `size` divides them; when `size` exceeds them
and is a multiple, each KV head is replicated on `size / num_kv_heads` consecutive ranks (8 query / 2 KV
heads at TP=4: ranks 0-1 hold KV head 0, ranks 2-3 KV head 1), which keeps each rank's query heads on the
KV head their group attends to.
"""
from __future__ import annotations

import dataclasses
import re

import torch

from engine.config import ModelConfig
from engine.kv_cache.spec import KVPageSpec
from engine.parallel.errors import ParallelConfigError
from engine.parallel.validate import validate_tp  # noqa: F401 - the degree check lives beside the others


def q_head_range(cfg: ModelConfig, rank: int, size: int) -> range:
    per = cfg.num_heads // size
    return range(rank * per, (rank + 1) * per)


def kv_head_range(num_kv_heads: int, rank: int, size: int) -> range:
    """Global KV heads held by `rank`; with replication (size > heads) one head shared by several ranks."""
    if size <= num_kv_heads:
        per = num_kv_heads // size
        return range(rank * per, (rank + 1) * per)
    head = rank // (size // num_kv_heads)
    return range(head, head + 1)


def kv_replicas(num_kv_heads: int, size: int) -> int:
    """How many ranks hold each KV head (1 unless the degree exceeds the KV heads)."""
    return max(1, size // num_kv_heads)


def local_config(cfg: ModelConfig, rank: int, size: int) -> ModelConfig:
    """The config a rank's forward runs with: its own head counts and intermediate widths (dense and expert)."""
    validate_tp(cfg, size)
    moe = cfg.moe and dataclasses.replace(cfg.moe, intermediate_size=cfg.moe.intermediate_size // size,
                                          shared_intermediate_size=cfg.moe.shared_intermediate_size // size)
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // size,
                               num_kv_heads=len(kv_head_range(cfg.num_kv_heads, rank, size)),
                               intermediate_size=cfg.intermediate_size // size, moe=moe)


Index = tuple[slice, ...]  # a basic index of one tensor (safetensors slices and torch tensors take it alike)
_EXPERT_COLUMN = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|w1|w3)\.weight$")  # [I, H]: rows
_EXPERT_ROW = re.compile(r"\.experts\.\d+\.(down_proj|w2)\.weight$")  # [H, I]: columns
_SHARED = re.compile(r"\.mlp\.shared_expert\.(gate_proj|up_proj|down_proj)\.weight$")  # Qwen2-MoE's


def _rows(dim: int, start: int, stop: int) -> Index:
    return (slice(None),) * dim + (slice(start, stop),)


def weight_parts(name: str, cfg: ModelConfig, rank: int, size: int) -> tuple[int, list[Index]] | None:
    """(dim, indexes): the parts of weight `name` that `rank` of `size` holds, concatenated along `dim`; None:
    the whole tensor. Shared by `shard_weights` (tensors in memory) and `load_shard` (safetensors slices, so
    a rank reads only its part of a large checkpoint)."""
    hd = cfg.head_dim
    if ".self_attn.q_proj." in name:  # weight [q_heads * hd, hidden] or bias [q_heads * hd]
        q = q_head_range(cfg, rank, size)
        return 0, [_rows(0, q.start * hd, q.stop * hd)]
    if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
        kv = kv_head_range(cfg.num_kv_heads, rank, size)
        return 0, [_rows(0, kv.start * hd, kv.stop * hd)]
    if name.endswith(".self_attn.o_proj.weight"):  # [hidden, q_heads * hd]: columns by query head
        q = q_head_range(cfg, rank, size)
        return 1, [_rows(1, q.start * hd, q.stop * hd)]
    if cfg.moe is not None and ".experts." in name:  # every expert split as a dense MLP
        full = cfg.moe.intermediate_size
        i = full // size
        lo, hi = rank * i, (rank + 1) * i
        if name.endswith(".experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
            return 1, [_rows(1, lo, hi), _rows(1, full + lo, full + hi)]
        if name.endswith(".experts.down_proj"):  # [E, H, I]
            return 2, [_rows(2, lo, hi)]
        if _EXPERT_COLUMN.search(name):
            return 0, [_rows(0, lo, hi)]
        if _EXPERT_ROW.search(name):
            return 1, [_rows(1, lo, hi)]
    shared = _SHARED.search(name) if cfg.moe is not None else None
    if shared is not None:  # a dense MLP of the shared expert's width: gate/up [S, H] rows, down [H, S] columns
        i = cfg.moe.shared_intermediate_size // size
        return (1, [_rows(1, rank * i, (rank + 1) * i)]) if shared.group(1) == "down_proj" else (
            0, [_rows(0, rank * i, (rank + 1) * i)])
    inter = cfg.intermediate_size // size
    if ".mlp.gate_proj." in name or ".mlp.up_proj." in name:  # [intermediate, hidden]
        return 0, [_rows(0, rank * inter, (rank + 1) * inter)]
    if name.endswith(".mlp.down_proj.weight"):  # [hidden, intermediate]
        return 1, [_rows(1, rank * inter, (rank + 1) * inter)]
    return None  # embedding, lm_head, norms, routers, shared_expert_gate: whole on every rank


def take_parts(t, parts: tuple[int, list[Index]] | None) -> torch.Tensor:
    """The rank's part of `t` (a tensor, or a safetensors slice read here) per `weight_parts`."""
    if parts is None:
        return t if isinstance(t, torch.Tensor) else t[:]
    dim, indexes = parts
    pieces = [t[ix] for ix in indexes]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def shard_weights(weights: dict[str, torch.Tensor], cfg: ModelConfig, rank: int,
                  size: int) -> dict[str, torch.Tensor]:
    """The weights `rank` of `size` holds, under the same Hugging Face names (views, except a fused gate_up's
    two parts; the model copies when it converts dtype/device)."""
    validate_tp(cfg, size)
    if not 0 <= rank < size:
        raise ParallelConfigError("tp_rank", f"{rank} outside [0, {size})")
    return {name: take_parts(t, weight_parts(name, cfg, rank, size)) for name, t in weights.items()}


def shard_kv_spec(spec: KVPageSpec, rank: int, size: int) -> KVPageSpec:
    """A rank's page pool: the replica's (unsharded) spec with the rank's KV heads and TP coordinates."""
    assert spec.tp_size == 1, "shard the replica's whole spec, not a shard"
    heads = kv_head_range(spec.num_kv_heads, rank, size)
    return dataclasses.replace(spec, num_kv_heads=len(heads), tp_rank=rank, tp_size=size)
