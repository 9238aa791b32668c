"""`RankWorker`: one tensor-parallel rank of a replica — its weight shard, its page pool, its forward.

Life cycle: the launcher (`launcher.py`, or a Ray actor in `cluster/`) constructs a `RankWorker` from a
`RankSpec` inside the rank's own process -> `__init__` joins the process group (gloo on CPU, NCCL on
CUDA), reads only this rank's slices of the checkpoint and builds a `ModelRunner` over its own KV backend
-> the driver sends every step's `StepBatch` to all ranks, each calls `execute` (the all-reduces inside
the forward keep them in lockstep) -> `close()` leaves the group. Process launch, pipes and shutdown are
the caller's business: this class only needs to run in a process of its own.

Page ids and slot counts in the batch are the driver's (one allocator per replica); every rank's pool
has the same number of pages, so the same page id addresses the same tokens on every rank, for the rank's
own KV heads. Rank 0 computes logits and samples (sampling is keyed by request seed, so the choice is the
same wherever it runs); other ranks get batches with no logits rows and return nothing.
"""
from __future__ import annotations

import dataclasses
import glob
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from safetensors import safe_open

from engine.batch import StepBatch, StepOutput
from engine.config import ModelConfig
from engine.kv_cache.backend import make_backend, torch_dtype
from engine.kv_cache.page_io import export_kv, import_kv
from engine.kv_cache.spec import KVPageSpec
from engine.loader import checkpoint_names, load_config
from engine.forward import build_forward
from engine.parallel.shard import local_config, shard_kv_spec, take_parts, validate_tp, weight_parts
from engine.runner import ModelRunner

LOOPBACK_HOSTS = ("127.0.0.1", "localhost")


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs to start: plain data, so it crosses a pipe or a Ray call unchanged."""

    model_dir: str
    dtype: str  # compute dtype, one of engine.kv_cache.spec.DTYPES
    rank: int
    size: int
    init_method: str  # "tcp://127.0.0.1:<port>": rendezvous (rank 0 hosts the store)
    kv_spec: KVPageSpec  # the replica's whole (unsharded) page spec; the rank holds its KV heads of it
    num_pages: int  # pages in the rank's pool: the driver's allocator hands out ids below this
    device: str = "cpu"  # "cuda": rank r uses cuda:r and NCCL ("cuda:N": that device)
    timeout_s: float = 300.0  # a collective waiting longer than this fails instead of hanging


def load_shard(model_dir: str | Path, cfg: ModelConfig, rank: int, size: int) -> dict[str, torch.Tensor]:
    """This rank's slices of the checkpoint, read slice by slice (never the whole tensor)."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(str(Path(model_dir) / "*.safetensors"))):
        with safe_open(f, framework="pt") as st:
            for stored, name in checkpoint_names(st):
                parts = weight_parts(name, cfg, rank, size)
                out[name] = st.get_tensor(stored) if parts is None else take_parts(st.get_slice(stored), parts)
    return out


def rank_device(device: str, rank: int) -> torch.device:
    """"cuda": rank r on cuda:r (local launcher, every GPU visible); "cuda:N" as given (a Ray actor sees
    only its own GPU, as cuda:0); anything else as given (CPU)."""
    return torch.device(f"cuda:{rank}") if device == "cuda" else torch.device(device)


def init_group(init_method: str, rank: int, size: int, cuda: bool, timeout_s: float) -> None:
    """Join the replica's process group: NCCL on CUDA, gloo on CPU (kept on loopback when the
    rendezvous is: gloo otherwise binds to the address the machine's hostname resolves to)."""
    host = urlparse(init_method).hostname
    if not cuda and host in LOOPBACK_HOSTS and os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s))


def close_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class KVPoolIO:
    """KV bytes in and out of this process's own page pool (`self.backend`), by layer and token range,
    for moving a request's KV between replicas of different layouts (`kv_io.py` on the driver)."""

    backend = None

    def export_kv(self, layers: list[int], pages: list[int], start: int, stop: int) -> list[tuple[bytes, bytes]]:
        """Per layer, stored K and V bytes of slots [start, stop): [n, local kv_heads, cell] each."""
        return [tuple(bytes(b) for b in export_kv(self.backend, layer, pages, start, stop)) for layer in layers]

    def import_kv(self, layer: int, pages: list[int], start: int, stop: int, payload: bytes,
                  head_start: int, head_end: int) -> None:
        """K-then-V bytes of local heads [head_start, head_end) into slots [start, stop)."""
        import_kv(self.backend, layer, pages, start, stop, payload, head_start, head_end)


class RankWorker(KVPoolIO):
    def __init__(self, spec: RankSpec):
        self.spec = spec
        self.rank, self.size = spec.rank, spec.size
        full_cfg = load_config(Path(spec.model_dir))
        validate_tp(full_cfg, spec.size)
        self.device = rank_device(spec.device, spec.rank)
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.set_device(self.device)
        init_group(spec.init_method, spec.rank, spec.size, cuda, spec.timeout_s)
        cfg = local_config(full_cfg, spec.rank, spec.size)
        weights = load_shard(spec.model_dir, full_cfg, spec.rank, spec.size)
        self.model = build_forward(cfg, weights, torch_dtype(spec.dtype), self.device, all_reduce=self._all_reduce)
        del weights
        self.kv_spec = shard_kv_spec(spec.kv_spec, spec.rank, spec.size)
        self.backend = make_backend(self.kv_spec, spec.num_pages, self.device)
        self.runner = ModelRunner(self.model, self.backend, self.kv_spec.page_size)

    @staticmethod
    def _all_reduce(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)  # in place: t is this rank's fresh partial product
        return t

    def execute(self, batch: StepBatch) -> StepOutput | None:
        """Run one step on this rank's heads; rank 0 returns the output (logits, samples)."""
        if self.rank != 0:
            batch = without_logits(batch)
        out = self.runner.execute(batch)
        return out if self.rank == 0 else None

    def close(self) -> None:
        close_group()


def without_logits(batch: StepBatch) -> StepBatch:
    """The batch a rank other than 0 runs: same tokens and pages, no logits rows, nothing to sample."""
    seqs = [dataclasses.replace(s, logits_at=[], sample=None) for s in batch.seqs]
    return StepBatch(seqs, return_logits=False, observe=None)
