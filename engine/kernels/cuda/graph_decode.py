"""Decode steps at static shapes: one CUDA graph per batch-size bucket, captured once at engine start.

Who calls it: `ModelRunner.execute` hands it every step batch `takes()` accepts (one new token per row, a
whole model in this process, Triton paged attention, no sparse/observed/windowed attention, no layer hooks);
other steps (prefill, verify, ...) run eagerly as before.

Per bucket of `b` rows, one int64 device buffer holds every input (ids, positions, write slots, context
lengths: b each; then the page table, column-major so the first P pages of every row are its first P x b
values). A step fills the pinned host mirror, copies the used prefix in one non-blocking transfer, replays
the graph (or, eagerly, calls the same `_forward`), then samples from the bucket's static logits: greedy
rows by an argmax on the GPU (only their token ids come back), others on the CPU (engine/sampler.py).
Padding rows have context length 0 (the kernel skips them) and write their K/V into the backend's scratch
page, which no request owns. No host sync inside a step: the only one is reading the sampled ids.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention_context import AttentionContext, AttnGroup
from engine.batch import SeqResult, StepBatch, StepOutput
from engine.sampler import sample_batch

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


@dataclass
class _Bucket:
    rows: int
    dev: torch.Tensor  # [4 * rows + rows * max_pages] int64 on the device
    host: torch.Tensor  # its pinned mirror on the host
    splits: int
    graph: object | None = None  # torch.cuda.CUDAGraph once captured
    logits: torch.Tensor | None = None  # [rows, vocab] float32, written by each replay

    def views(self, max_pages: int):
        b = self.rows
        d = self.dev
        table = d[4 * b:].view(max_pages, b).t()  # [b, max_pages], column-major
        return d[:b], d[b:2 * b], d[2 * b:3 * b], d[3 * b:4 * b], table


class GraphDecode:
    def __init__(self, model, backend, page_size: int, max_batch: int, max_model_len: int, use_graphs: bool = True):
        self.model, self.backend, self.page_size = model, backend, page_size
        self.device = model.device
        self.max_pages = -(-max_model_len // page_size)
        self.use_graphs = use_graphs and self.device.type == "cuda"
        from engine.kernels.cuda.paged_attention import num_splits  # imports triton: only where it runs

        sizes = [b for b in BUCKETS if b < max_batch] + [max_batch]
        kv_heads = backend.spec.num_kv_heads
        pin = self.device.type == "cuda"
        self.buckets: dict[int, _Bucket] = {}
        for b in sizes:
            n = 4 * b + b * self.max_pages
            self.buckets[b] = _Bucket(b, torch.zeros(n, dtype=torch.long, device=self.device),
                                      torch.zeros(n, dtype=torch.long, pin_memory=pin),
                                      num_splits(b, kv_heads, max_model_len, backend._sm_count))
        self.capture_s = 0.0
        self.pool = None
        self._copied = None  # CUDA event: the last upload from the pinned mirror finished

    # ---- eligibility --------------------------------------------------------------------------
    def takes(self, batch: StepBatch) -> bool:
        if batch.observe or batch.sparse or self.backend.sparse is not None or len(batch.seqs) > max(self.buckets):
            return False
        for s in batch.seqs:
            if len(s.token_ids) != 1 or s.logits_at != [0] or s.num_cached // self.page_size >= self.max_pages:
                return False
        return True

    # ---- the static step --------------------------------------------------------------------
    def _forward(self, bk: _Bucket) -> torch.Tensor:
        """The step the graph captures: [rows, vocab] float32 logits from the bucket's static inputs."""
        ids, pos, slots, lens, table = bk.views(self.max_pages)
        group = AttnGroup(0, bk.rows, bk.rows, 1, [], [self.max_pages * self.page_size] * bk.rows, table, None,
                          False, lens=lens, splits=bk.splits)
        ctx = AttentionContext(slots, [group], self.model.scale)
        return self.model.logits(self.model.forward(ids, pos, ctx, self.backend))

    @torch.inference_mode()
    def capture(self) -> float:
        """Warm up every bucket (Triton compiles here) and, on CUDA, capture its graph; seconds taken."""
        t0 = time.perf_counter()
        for bk in sorted(self.buckets.values(), key=lambda x: -x.rows):  # largest first: one memory pool
            self._pad(bk, 0)
            bk.dev.copy_(bk.host)
            if not self.use_graphs:
                continue
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward(bk)
            torch.cuda.current_stream(self.device).wait_stream(side)
            bk.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(bk.graph, pool=self.pool):
                bk.logits = self._forward(bk)
            self.pool = bk.graph.pool()
        if self.use_graphs:
            torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - t0
        return self.capture_s

    def _pad(self, bk: _Bucket, n: int) -> None:
        """Rows n.. of the host mirror as padding: id 0, position 0, the scratch slot, length 0."""
        b = bk.rows
        h = bk.host
        h[n:b] = 0
        h[b + n:2 * b] = 0
        h[2 * b + n:3 * b] = self.backend.scratch_slot
        h[3 * b + n:4 * b] = 0

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> StepOutput:
        n = len(batch.seqs)
        bk = self.buckets[min(b for b in self.buckets if b >= n)]
        b, ps = bk.rows, self.page_size
        if self._copied is not None:  # the last step's upload must be done before its host rows change
            self._copied.synchronize()
        pages = max(s.num_cached // ps + 1 for s in batch.seqs)  # page-table columns in use
        h = bk.host.numpy()
        table = h[4 * b:4 * b + pages * b].reshape(pages, b)
        table[:] = 0
        for r, s in enumerate(batch.seqs):
            used = s.num_cached // ps + 1
            h[r], h[b + r], h[3 * b + r] = s.token_ids[0], s.position_start, s.num_cached + 1
            h[2 * b + r] = s.pages[used - 1] * ps + s.num_cached % ps
            table[:used, r] = s.pages[:used]
        self._pad(bk, n)
        end = 4 * b + pages * b
        bk.dev[:end].copy_(bk.host[:end], non_blocking=True)
        if self.use_graphs:
            self._copied = torch.cuda.Event()
            self._copied.record()
        if bk.graph is not None:
            bk.graph.replay()
            logits = bk.logits
        else:
            logits = self._forward(bk)
        return StepOutput(self._results(batch, logits[:n]))

    def _results(self, batch: StepBatch, logits: torch.Tensor) -> list[SeqResult]:
        results = [SeqResult(s.request_id) for s in batch.seqs]
        if batch.return_logits:
            for i, r in enumerate(results):
                r.logits = logits[i:i + 1].clone()
        rows = [i for i, s in enumerate(batch.seqs) if s.sample is not None]
        if rows:
            every = len(rows) == len(results)
            tokens = sample_batch(logits if every else logits[rows], [batch.seqs[i].sample for i in rows])
            for i, t in zip(rows, tokens):
                results[i].sampled = t
        return results


MODES = ("auto", "static", "off")


def attach(runner, max_num_seqs: int, max_model_len: int, mode: str = "auto") -> GraphDecode | None:
    """Give `runner` static-shape decode steps where they run: "auto" captures CUDA graphs on CUDA when
    attention takes the Triton path; "static" runs the same static step eagerly (any device: the CPU tests,
    or an eager comparison on the GPU); "off" (or a model or KV format the step does not cover) keeps every
    step eager. Captures at once (the Triton compiles too) and records the seconds in `capture_s`."""
    from engine.errors import InvalidRequestError
    from engine.kv_cache.backend import RawKVBackend
    from engine.kv_cache.quantized import QuantizedKVBackend

    if mode not in MODES:
        raise InvalidRequestError("decode_graphs", f"{mode!r} is not one of {', '.join(MODES)}")
    model, backend = runner.model, runner.backend
    whole = model.is_first and model.is_last and model.all_reduce is None
    plain_pages = type(backend) in (RawKVBackend, QuantizedKVBackend) and backend.triton_paged
    if mode == "off" or not whole or not plain_pages or model.cfg.sliding_window is not None:
        return None
    if mode == "auto" and model.device.type != "cuda":
        return None
    graphs = GraphDecode(model, backend, runner.page_size, max_num_seqs, max_model_len, use_graphs=mode == "auto")
    graphs.capture()
    runner.graphs = graphs
    return graphs
