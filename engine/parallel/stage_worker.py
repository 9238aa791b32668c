"""`StageWorker`: one pipeline stage of a replica — its layers' weights, its layers' pages, its part of
every step.

Life cycle, as `RankWorker`'s: built from a `StageSpec` inside the stage's own process (launcher or a Ray
actor) -> joins the process group (the stage is the rank) -> reads only its tensors of the checkpoint
(`stages.stage_wants`) -> per step, every stage gets the `StepBatch` and cuts it into the same
micro-batches; per micro-batch a stage receives the previous stage's hidden states (the first embeds the
ids), runs its layers over its own pages, and sends the result on with a non-blocking send, so it can
start the next micro-batch while the next stage works on this one. The last stage computes logits,
samples and returns the step's output; the others return None. `close()` leaves the group.
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
from engine.loader import checkpoint_names, load_config
from engine.forward import build_forward
from engine.parallel.rank_worker import KVPoolIO, close_group, init_group, rank_device
from engine.parallel.stages import micro_batches, stage_kv_spec, stage_layers, stage_wants, validate_pp
from engine.runner import ModelRunner


@dataclass(frozen=True)
class StageSpec:
    """Everything a stage needs to start: plain data (crosses a pipe or a Ray call unchanged)."""

    model_dir: str
    dtype: str
    stage: int  # also the stage's rank in the process group
    num_stages: int
    init_method: str  # "tcp://127.0.0.1:<port>"
    kv_spec: KVPageSpec  # the replica's whole page spec; the stage holds its layers of it
    num_pages: int
    device: str = "cpu"  # "cuda": stage s uses cuda:s and NCCL ("cuda:N": that device)
    timeout_s: float = 300.0
    micro_batches: int = 0  # micro-batches per step; 0: one per stage


def load_stage(model_dir: str | Path, cfg: ModelConfig, layers: range) -> dict[str, torch.Tensor]:
    """The checkpoint tensors a stage holding `layers` needs, and nothing else."""
    files = sorted(glob.glob(str(Path(model_dir) / "*.safetensors")))
    names: dict[str, str] = {}
    for f in files:
        with safe_open(f, framework="pt") as st:
            names.update((n, f) for _, n in checkpoint_names(st))
    tied = cfg.tie_word_embeddings or "lm_head.weight" not in names
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(f, framework="pt") as st:
            for stored, n in checkpoint_names(st):
                if stage_wants(n, cfg, layers, tied):
                    out[n] = st.get_tensor(stored)
    return out


class StageWorker(KVPoolIO):
    def __init__(self, spec: StageSpec):
        self.spec = spec
        cfg = load_config(Path(spec.model_dir))
        validate_pp(cfg, spec.num_stages)
        self.stage, self.num_stages = spec.stage, spec.num_stages
        self.layers = stage_layers(cfg.num_layers, spec.stage, spec.num_stages)
        self.first, self.last = spec.stage == 0, spec.stage == spec.num_stages - 1
        self.device = rank_device(spec.device, spec.stage)
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.set_device(self.device)
        init_group(spec.init_method, spec.stage, spec.num_stages, cuda, spec.timeout_s)
        self.dtype = torch_dtype(spec.dtype)
        self.hidden_size = cfg.hidden_size
        weights = load_stage(spec.model_dir, cfg, self.layers)
        self.model = build_forward(cfg, weights, self.dtype, self.device, layers=self.layers)
        del weights
        self.kv_spec = stage_kv_spec(spec.kv_spec, self.layers)
        self.backend = make_backend(self.kv_spec, spec.num_pages, self.device)
        self.runner = ModelRunner(self.model, self.backend, self.kv_spec.page_size)
        self.num_micro = spec.micro_batches or spec.num_stages

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> StepOutput | None:
        outs: list[StepOutput] = []
        sends = []  # (work, tensor): a tensor must live until its send completes
        for mb in micro_batches(batch, self.num_micro):
            hidden = None
            if not self.first:
                hidden = torch.empty(mb.num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
                dist.recv(hidden, src=self.stage - 1)  # [num_tokens, hidden] from the previous stage
            hidden, rows, ctx = self.runner.run_layers(mb, hidden)
            if self.last:
                outs.append(self.runner.finish(mb, hidden, rows, ctx))
            else:
                hidden = hidden.contiguous()
                sends.append((dist.isend(hidden, dst=self.stage + 1), hidden))
        for work, _ in sends:
            work.wait()
        if not self.last:
            return None
        return StepOutput([r for o in outs for r in o.results])

    def close(self) -> None:
        close_group()
