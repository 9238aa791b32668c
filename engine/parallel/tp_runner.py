"""Driver-side runners of a parallel replica, with `ModelRunner`'s surface: `TPRunner` (tensor
parallel), `PPRunner` (pipeline parallel) and `EPRunner` (expert parallel).

`LLM(tensor_parallel_size=N)` / `LLM(pipeline_parallel_size=N)` / `LLM(expert_parallel_size=N)` builds one
(`make_parallel_runner`) in place of `ModelRunner`; the scheduler, the page allocator and the block tables
stay in the driver, unchanged. Per step: `execute(batch)` sends the `StepBatch` (plain data) to the N processes of
`RankProcesses` — the output rank (TP, EP: rank 0; PP: the last stage) the whole batch, the others a copy
without logits rows or sampling — and returns the output rank's `StepOutput`; `EPDataRunner` (expert parallelism
with data-parallel attention) instead sends each rank its own sequences and merges their outputs. `close()` (also run by
`LLM.close()` and at interpreter exit) shuts the processes down. `check_supported` validates the degrees
and names the `LLM` options that cannot run across processes yet, before anything is loaded or started.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from engine.batch import PendingStep, SeqStep, StepBatch, StepOutput
from engine.config import ModelConfig
from engine.kv_cache.spec import KVPageSpec
from engine.parallel.errors import UnsupportedWithParallelError
from engine.parallel.expert_worker import ExpertSpec
from engine.parallel.launcher import RankProcesses, free_port, output_from_wire
from engine.parallel.rank_worker import RankSpec, without_logits
from engine.parallel.shard import kv_head_range, shard_kv_spec, validate_tp
from engine.parallel.stage_worker import StageSpec
from engine.parallel.stages import stage_kv_spec, stage_layers, validate_pp
from engine.parallel.validate import check_supported, validate_ep  # noqa: F401 - `LLM` imports check_supported


def make_parallel_runner(model_dir: str | Path, cfg: ModelConfig, dtype: str, kv_spec: KVPageSpec,
                         num_pages: int, tp: int, pp: int, device: str = "cpu", ep: int = 1,
                         expert_attention: str = "replicated"):
    check_supported(cfg, tp, pp=pp, ep=ep)
    if ep > 1 and expert_attention == "data":
        return EPDataRunner(model_dir, cfg, dtype, kv_spec, num_pages, ep, device, tp)
    if ep > 1:
        return EPRunner(model_dir, cfg, dtype, kv_spec, num_pages, ep, device, tp)
    if pp > 1:
        return PPRunner(model_dir, cfg, dtype, kv_spec, num_pages, pp, device)
    return TPRunner(model_dir, cfg, dtype, kv_spec, num_pages, tp, device)


class _ParallelRunner:
    output_rank = 0

    def __init__(self, kv_spec: KVPageSpec, size: int, specs: list):
        self.size = size
        self.page_size = kv_spec.page_size
        self.device = torch.device("cpu")  # where outputs arrive, whatever the ranks compute on
        self.kv_spec = kv_spec  # the replica's whole layout; see rank_kv_spec for each process's part
        self.ranks = RankProcesses(specs)

    @property
    def pids(self) -> list[int]:
        return list(self.ranks.pids)

    def add_layer_hook(self, hook) -> None:
        raise UnsupportedWithParallelError("layer hooks", "layers run inside the rank processes; layer-wise "
                                                          "KV publishing needs per-rank senders")

    def remove_layer_hook(self, hook) -> None:
        raise ValueError("no layer hooks are registered on a parallel runner")

    def execute(self, batch: StepBatch) -> StepOutput:
        assert batch.seqs, "empty step batch"
        if batch.observe:
            raise UnsupportedWithParallelError("StepBatch.observe", "attention observation")
        rest = without_logits(batch)
        replies = self.ranks.call([batch if r == self.output_rank else rest for r in range(self.size)])
        assert sum(r is not None for r in replies) == 1, "exactly the output rank answers with an output"
        return output_from_wire(replies[self.output_rank])

    def launch(self, batch: StepBatch) -> PendingStep:
        """`ModelRunner.launch`'s interface: the ranks' step runs to its end here."""
        return PendingStep.done(self.execute(batch))

    def close(self) -> None:
        self.ranks.close()


class TPRunner(_ParallelRunner):
    def __init__(self, model_dir: str | Path, cfg: ModelConfig, dtype: str, kv_spec: KVPageSpec, num_pages: int,
                 size: int, device: str = "cpu"):
        validate_tp(cfg, size)
        init = f"tcp://127.0.0.1:{free_port()}"
        specs = [RankSpec(str(model_dir), dtype, r, size, init, kv_spec, num_pages, device) for r in range(size)]
        super().__init__(kv_spec, size, specs)

    def rank_kv_spec(self, rank: int) -> KVPageSpec:
        return shard_kv_spec(self.kv_spec, rank, self.size)

    def rank_kv_heads(self, rank: int) -> range:
        """Global KV heads rank `rank` holds."""
        return kv_head_range(self.kv_spec.num_kv_heads, rank, self.size)

    def holders(self) -> list[tuple[int, range, range]]:
        """(rank, global KV heads, global layers) of every rank's pool (`kv_io.py` routes by these)."""
        layers = range(self.kv_spec.num_layers)
        return [(r, self.rank_kv_heads(r), layers) for r in range(self.size)]


class PPRunner(_ParallelRunner):
    def __init__(self, model_dir: str | Path, cfg: ModelConfig, dtype: str, kv_spec: KVPageSpec, num_pages: int,
                 size: int, device: str = "cpu", micro_batches: int = 0):
        validate_pp(cfg, size)
        self.output_rank = size - 1  # the last stage holds the LM head
        self.num_layers = cfg.num_layers
        init = f"tcp://127.0.0.1:{free_port()}"
        specs = [StageSpec(str(model_dir), dtype, s, size, init, kv_spec, num_pages, device,
                           micro_batches=micro_batches) for s in range(size)]
        super().__init__(kv_spec, size, specs)

    def stage_layers(self, stage: int) -> range:
        """Global layer ids stage `stage` holds."""
        return stage_layers(self.num_layers, stage, self.size)

    def holders(self) -> list[tuple[int, range, range]]:
        """(stage, global KV heads, global layers) of every stage's pool (`kv_io.py` routes by these)."""
        heads = range(self.kv_spec.num_kv_heads)
        return [(s, heads, self.stage_layers(s)) for s in range(self.size)]

    def rank_kv_spec(self, stage: int) -> KVPageSpec:
        return stage_kv_spec(self.kv_spec, self.stage_layers(stage))


class EPRunner(_ParallelRunner):
    """Expert ranks (`expert_worker.py`): each holds the whole attention and a page pool of the replica's whole
    spec, so KV is exported from rank 0 and imported into every rank (`kv_io.py`, by `holders`). With `tp` > 1,
    `size` groups of `tp` ranks (world rank e * tp + t): each rank holds TP rank t's KV heads, in every group."""

    def __init__(self, model_dir: str | Path, cfg: ModelConfig, dtype: str, kv_spec: KVPageSpec, num_pages: int,
                 size: int, device: str = "cpu", tp: int = 1):
        validate_ep(cfg, size)
        validate_tp(cfg, tp)
        self.tp = tp
        init = f"tcp://127.0.0.1:{free_port()}"
        specs = [ExpertSpec(str(model_dir), dtype, r, size, init, kv_spec, num_pages, device, tp=tp)
                 for r in range(size * tp)]
        super().__init__(kv_spec, size * tp, specs)

    def rank_kv_spec(self, rank: int) -> KVPageSpec:
        return shard_kv_spec(self.kv_spec, rank % self.tp, self.tp) if self.tp > 1 else self.kv_spec

    def holders(self) -> list[tuple[int, range, range]]:
        """(rank, global KV heads, global layers): every group holds every head of every layer (each of its ranks
        its TP heads)."""
        layers = range(self.kv_spec.num_layers)
        return [(r, kv_head_range(self.kv_spec.num_kv_heads, r % self.tp, self.tp), layers) for r in range(self.size)]


class EPDataRunner(_ParallelRunner):
    """Expert ranks with data-parallel attention (`expert_worker.py`, `dispatch.py`): expert group g holds pages
    [g * P, (g + 1) * P) of the replica's `num_pages` (its partition of the driver's `PageAllocator`, P = num_pages
    / groups, as local pages 0..P-1), attends the sequences whose pages are there, and trades tokens with the other
    groups in every MoE layer. Per step each group gets its own rows (none: it still serves the others' tokens),
    and its first rank answers with their outputs, merged here in the batch's order. With `tp` > 1 a group is `tp`
    ranks (world rank g * tp + t), each its TP heads of the group's pool; ranks t > 0 run the rows without logits.
    KV in and out goes to the group holding a request's pages (`pools_of`, read by `kv_io.py`)."""

    def __init__(self, model_dir: str | Path, cfg: ModelConfig, dtype: str, kv_spec: KVPageSpec, num_pages: int,
                 size: int, device: str = "cpu", tp: int = 1):
        validate_ep(cfg, size)
        validate_tp(cfg, tp)
        if num_pages % size:
            raise ValueError(f"{num_pages} pages do not split over {size} expert groups")
        self.groups, self.tp, self.rank_pages = size, tp, num_pages // size
        init = f"tcp://127.0.0.1:{free_port()}"
        specs = [ExpertSpec(str(model_dir), dtype, r, size, init, kv_spec, self.rank_pages, device, tp=tp,
                            attention="data") for r in range(size * tp)]
        super().__init__(kv_spec, size * tp, specs)

    def group_of(self, pages: list[int]) -> tuple[int, list[int]]:
        """(expert group, its local page ids) of a page table (all of a sequence's pages are in one partition)."""
        group = pages[0] // self.rank_pages
        local = [p - group * self.rank_pages for p in pages]
        # (the allocator keeps an owner's pages in one partition; the last page checks the table's end cheaply)
        assert 0 <= local[-1] < self.rank_pages, "a page table spans two expert groups' pools"
        return group, local

    def pools_of(self, pages: list[int]) -> list[tuple[int, range, range, list[int]]]:
        """(rank, global KV heads, global layers, local page ids) of every rank holding a page table's KV."""
        group, local = self.group_of(pages)
        layers = range(self.kv_spec.num_layers)
        return [(group * self.tp + t, kv_head_range(self.kv_spec.num_kv_heads, t, self.tp), layers, local)
                for t in range(self.tp)]

    def execute(self, batch: StepBatch) -> StepOutput:
        assert batch.seqs, "empty step batch"
        if batch.observe:
            raise UnsupportedWithParallelError("StepBatch.observe", "attention observation")
        parts: list[list[SeqStep]] = [[] for _ in range(self.groups)]
        for s in batch.seqs:
            group, local = self.group_of(s.pages)
            parts[group].append(replace(s, pages=local))
        subs = [replace(batch, seqs=seqs) for seqs in parts]
        rest = [without_logits(sub) for sub in subs] if self.tp > 1 else subs  # TP ranks t > 0: no logits
        replies = self.ranks.call([subs[r // self.tp] if r % self.tp == 0 else rest[r // self.tp]
                                   for r in range(self.size)])
        results = {r.request_id: r for reply in replies if reply is not None for r in output_from_wire(reply).results}
        return StepOutput([results[s.request_id] for s in batch.seqs])
