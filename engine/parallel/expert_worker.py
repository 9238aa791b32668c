"""`ExpertWorker`: one expert-parallel rank of a replica -- the whole attention and dense parts, its block of
every MoE layer's experts, a page pool.

Data-parallel attention (`ExpertSpec.attention == "data"`, the driver's default, with or without TP,
`tp_runner.EPDataRunner`): the rank's pool is its share of the replica's pages, each step brings only the
sequences whose pages are here (in local page numbers; possibly none), and every MoE layer sends this rank's
tokens to the ranks of their experts and back (`dispatch.AllToAllDispatch`; a step with no rows still joins
every exchange). The rank samples its own rows and returns its output. With TP (`tp` > 1) a group of TP ranks
attends its sequences (each rank its heads, reduced in the group); rank (e, t) trades tokens with the ranks (e', t)
of the other groups, which hold TP slice t of their experts, and the group's all-reduce then sums the slices
(`LlamaForward._moe`); rank t = 0 of a group samples and answers. What follows is the replicated layout.

Life cycle, as `RankWorker`'s: the launcher (`launcher.py`, inside a Ray actor in `cluster/`) builds it from
an `ExpertSpec` in the rank's own process -> `__init__` joins the process group (gloo on CPU, NCCL on CUDA),
reads the checkpoint without the other ranks' experts (`experts.expert_slice`) and builds a `ModelRunner`
over a page pool of the replica's whole `KVPageSpec` -> every step's `StepBatch` goes to all ranks: each
computes the attention of every token (replicated), routes every token over all experts (the router is whole,
its inputs identical on every rank: bit-identical as long as the ranks' kernels are deterministic, as on CPU),
runs only its own experts on the tokens routed to them, and the
partial MoE outputs are summed with one all-reduce per MoE layer (`LlamaForward(expert_reduce=...)`) -> rank
0 returns the output (logits, samples), the others None -> `close()` leaves the group.

With tensor parallelism (`ExpertSpec.tp` > 1): `size` expert groups of `tp` ranks, world rank g = e * tp + t.
Rank (e, t) holds query/KV heads and dense MLP slices of TP rank t (`shard.weight_parts`), and expert block e
with every expert split by its width as a TP rank's; attention and dense layers reduce over its group's tp ranks
(`all_reduce`, a gloo/NCCL subgroup), the MoE output over all size x tp ranks (`expert_reduce`: the world), one
all-reduce each as before. Every group holds the whole replica's KV, each rank its TP heads of it.

Why an all-reduce there, not all-to-all dispatch/combine: with attention replicated, every rank already holds every
token's hidden state, so there is nothing to dispatch; the combine is a sum. Each rank's KV is the whole
replica's, so KV written into any rank's pool is written into all of them (`kv_io.py`: exported from rank
0, imported everywhere).
"""
from __future__ import annotations

import glob
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

from engine.batch import StepBatch, StepOutput
from engine.config import ModelConfig
from engine.kv_cache.backend import make_backend, torch_dtype
from engine.kv_cache.spec import KVPageSpec
from engine.loader import load_config
from engine.model import LlamaForward
from engine.parallel.dispatch import AllToAllDispatch
from engine.parallel.experts import expert_slice, rank_experts
from engine.parallel.rank_worker import KVPoolIO, close_group, init_group, rank_device, without_logits
from engine.parallel.shard import local_config, shard_kv_spec, take_parts, weight_parts
from engine.runner import ModelRunner


@dataclass(frozen=True)
class ExpertSpec:
    """Everything an expert rank needs to start: plain data (crosses a pipe or a Ray call unchanged)."""

    model_dir: str
    dtype: str
    rank: int
    size: int
    init_method: str  # "tcp://127.0.0.1:<port>"
    kv_spec: KVPageSpec  # the replica's whole page spec: every expert rank holds all of it
    num_pages: int
    device: str = "cpu"  # "cuda": rank r uses cuda:r and NCCL ("cuda:N": that device)
    timeout_s: float = 300.0
    tp: int = 1  # tensor-parallel ranks per expert group; `rank` is then the world rank e * tp + t
    # "replicated": every rank attends every sequence (its pool the replica's whole KV); "data": each rank
    # attends its own sequences (its pool its share of the replica's pages) and MoE layers exchange tokens
    attention: str = "replicated"


def load_expert_shard(model_dir: str | Path, experts: range, cfg: ModelConfig | None = None, tp_rank: int = 0,
                      tp: int = 1) -> dict[str, torch.Tensor]:
    """The checkpoint without other ranks' experts; fused expert tensors read as the rank's rows only; with
    `tp` > 1, TP rank `tp_rank`'s slices of what it reads (`shard.weight_parts`)."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(str(Path(model_dir) / "*.safetensors"))):
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                part = expert_slice(name, experts)
                if part is False:
                    continue
                parts = weight_parts(name, cfg, tp_rank, tp) if tp > 1 else None
                if part is not True:  # a fused [E, ...] tensor: the rank's experts (dim 0), then its TP slices
                    rows = slice(part.start, part.stop)
                    parts = (0, [(rows,)]) if parts is None else (parts[0], [(rows,) + ix[1:] for ix in parts[1]])
                out[name] = st.get_tensor(name) if parts is None else take_parts(st.get_slice(name), parts)
    return out


def expert_model(model_dir: str | Path, cfg: ModelConfig, dtype: str, rank: int, size: int,
                 device: torch.device | str = "cpu", expert_reduce=None, tp_rank: int = 0, tp: int = 1,
                 all_reduce=None, expert_dispatch=None) -> LlamaForward:
    """Expert rank `rank` of `size`'s forward: its block of experts; the attention and dense parts whole, or
    with `tp` > 1 TP rank `tp_rank`'s shard of them and of each expert (`all_reduce` over its TP group)."""
    experts = rank_experts(cfg, rank, size)
    weights = load_expert_shard(model_dir, experts, cfg, tp_rank, tp)
    local = local_config(cfg, tp_rank, tp) if tp > 1 else cfg
    return LlamaForward(local, weights, torch_dtype(dtype), device, all_reduce=all_reduce, experts=experts,
                        expert_reduce=expert_reduce, expert_dispatch=expert_dispatch)


class ExpertWorker(KVPoolIO):
    def __init__(self, spec: ExpertSpec):
        self.spec = spec
        self.rank, self.size, tp = spec.rank, spec.size * spec.tp, spec.tp  # size: the world
        group, t = divmod(spec.rank, tp)  # expert group and TP rank in it
        cfg = load_config(Path(spec.model_dir))
        self.device = rank_device(spec.device, spec.rank)
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.set_device(self.device)
        init_group(spec.init_method, spec.rank, self.size, cuda, spec.timeout_s)
        self._tp_group = None
        if tp > 1:  # every rank creates every group, in the same order (torch.distributed's rule)
            self._tp_group = [dist.new_group(list(range(g * tp, (g + 1) * tp))) for g in range(spec.size)][group]
        self.dispatch, self.tp_rank = None, t
        if spec.attention == "data":  # tokens trade between the ranks of one TP index t, one in each group
            ep_groups = [dist.new_group([e * tp + u for e in range(spec.size)]) for u in range(tp)] if tp > 1 else [None]
            self.dispatch = AllToAllDispatch(group, spec.size, cfg.moe.num_experts // spec.size, ep_groups[t])
        self.model = expert_model(spec.model_dir, cfg, spec.dtype, group, spec.size, self.device,
                                  None if self.dispatch else self._all_reduce, t, tp,
                                  self._tp_all_reduce if tp > 1 else None, self.dispatch)
        self.kv_spec = shard_kv_spec(spec.kv_spec, t, tp) if tp > 1 else spec.kv_spec
        self.backend = make_backend(self.kv_spec, spec.num_pages, self.device)
        self.runner = ModelRunner(self.model, self.backend, self.kv_spec.page_size)

    @staticmethod
    def _all_reduce(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)  # in place: t is this rank's fresh partial MoE output
        return t

    def _tp_all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=self._tp_group)  # in place: this rank's partial o / dense down product
        return t

    def execute(self, batch: StepBatch) -> StepOutput | None:
        """Run one step (all tokens' attention, this rank's experts); rank 0 returns the output. With data-parallel
        attention: this rank's sequences (none: it only serves the others' tokens their experts), its output."""
        if self.dispatch is not None:  # (TP ranks t > 0 of a group get its rows without logits)
            if not batch.seqs:
                moe = [lw.moe for lw in self.model.layers if lw.moe is not None]
                self.dispatch.idle(moe, self.model.cfg.hidden_size, self.model.dtype, self.device)
                return None
            out = self.runner.execute(batch)
            return out if self.tp_rank == 0 else None
        out = self.runner.execute(batch if self.rank == 0 else without_logits(batch))
        return out if self.rank == 0 else None

    def close(self) -> None:
        close_group()
