"""`TPRunner`: the driver-side runner of a tensor-parallel replica, with `ModelRunner`'s surface.

`LLM(tensor_parallel_size=N)` builds one in place of `ModelRunner`; the scheduler, the page allocator and
the block tables stay in the driver, unchanged. Per step: `execute(batch)` sends the `StepBatch` (plain
data) to the N ranks of `RankProcesses` — rank 0 the whole batch, the others a copy without logits rows or
sampling — and returns rank 0's `StepOutput`. `close()` (also run by `LLM.close()` and at interpreter
exit) shuts the ranks down. `check_supported` names the `LLM` options that cannot run across ranks yet.
"""
from __future__ import annotations

from pathlib import Path

import torch

from engine.batch import StepBatch, StepOutput
from engine.config import ModelConfig
from engine.kv_cache.spec import KVPageSpec
from engine.parallel.errors import UnsupportedWithParallelError
from engine.parallel.launcher import RankProcesses, free_port, output_from_wire
from engine.parallel.rank_worker import RankSpec, without_logits
from engine.parallel.shard import kv_head_range, shard_kv_spec, validate_tp


def check_supported(cfg: ModelConfig, size: int, speculative=None, kv_eviction=None) -> None:
    """ParallelConfigError if `size` does not split `cfg`; UnsupportedWithParallelError for options whose
    state lives beside one model and one page pool. Runs before any weight is read or process started."""
    validate_tp(cfg, size)
    if speculative is not None:
        raise UnsupportedWithParallelError("speculative", "draft-verify decoding runs proposers and drafts "
                                                          "against a single-process model")
    if kv_eviction is not None:
        raise UnsupportedWithParallelError("kv_eviction", "eviction observes attention and compacts pages "
                                                          "in one local page pool")


class TPRunner:
    def __init__(self, model_dir: str | Path, cfg: ModelConfig, dtype: str, kv_spec: KVPageSpec, num_pages: int,
                 size: int, device: str = "cpu"):
        validate_tp(cfg, size)
        self.cfg = cfg
        self.size = size
        self.page_size = kv_spec.page_size
        self.device = torch.device("cpu")  # where outputs arrive, whatever the ranks compute on
        self.kv_spec = kv_spec  # the replica's whole layout; rank r holds rank_kv_spec(r)
        init = f"tcp://127.0.0.1:{free_port()}"
        specs = [RankSpec(str(model_dir), dtype, r, size, init, kv_spec, num_pages, device) for r in range(size)]
        self.ranks = RankProcesses(specs)

    def rank_kv_spec(self, rank: int) -> KVPageSpec:
        return shard_kv_spec(self.kv_spec, rank, self.size)

    def rank_kv_heads(self, rank: int) -> range:
        """Global KV heads rank `rank` holds (the seam for KV resharding on transfer)."""
        return kv_head_range(self.kv_spec.num_kv_heads, rank, self.size)

    @property
    def pids(self) -> list[int]:
        return list(self.ranks.pids)

    def add_layer_hook(self, hook) -> None:
        raise UnsupportedWithParallelError("layer hooks", "layers run inside the rank processes; layer-wise "
                                                          "KV publishing needs per-rank senders")

    def remove_layer_hook(self, hook) -> None:
        raise ValueError("no layer hooks are registered on a tensor-parallel runner")

    def execute(self, batch: StepBatch) -> StepOutput:
        assert batch.seqs, "empty step batch"
        if batch.observe:
            raise UnsupportedWithParallelError("StepBatch.observe", "attention observation")
        rest = without_logits(batch)
        replies = self.ranks.call([batch] + [rest] * (self.size - 1))
        assert all(r is None for r in replies[1:]), "only rank 0 answers with an output"
        return output_from_wire(replies[0])

    def close(self) -> None:
        self.ranks.close()
