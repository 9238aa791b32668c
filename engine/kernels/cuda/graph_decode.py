"""Decode steps at static shapes: one CUDA graph per batch-size bucket, captured once at engine start.

Who calls it: `ModelRunner.launch` hands it every step batch `takes()` accepts (one new token per row, or
up to 1 + k verify tokens per row when the engine drafts; a whole model in this process, Triton paged
attention, no observed/windowed attention, no per-request sparse configs, no layer hooks); other steps
(prefill chunks, ...) run eagerly as before.

Per bucket of `b` rows and `q` query tokens a row (1 for decode; 1 + k for verify, rows with fewer drafts
padded), one int64 device buffer holds every input (ids, positions, write slots: b x q each; context lengths:
b; the written pages and their filled extents: b x q each, for page summaries; then the page table,
column-major so the first P pages of every row are its first P x b values). A step fills the pinned host
mirror, copies the used prefix in one non-blocking transfer, replays the graph (or, eagerly, calls the same
`_forward`). Sampling: when every row is plain greedy, the argmax runs on the GPU; when the engine samples on
the device (`sampler`, engine/device_sampler.py) and every row is device-eligible (no penalties, logprobs or
min_tokens mask), the bucket's sampling graph draws them (graph_sampling.py, its parameters uploaded with
the inputs). Either way only the B ids head for pinned memory while `launch` returns: the engine detokenizes
the previous step meanwhile and reads the ids after (`PendingStep`). Other batches are sampled from the
bucket's logits by `sample_step`: device-eligible rows on the device, the rest on the CPU from a host copy
of only their rows.
Padding rows have context length 0 (the kernels skip them) and write their K/V into the backend's scratch
page, which no request owns. Sparse (Quest) engines: the choice runs on the device at fixed shapes
(quest.py), the written pages' summaries recomputed from extents the host keeps. No host sync inside a step:
the only one is reading the sampled ids.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention_context import AttentionContext, AttnGroup
from engine.batch import PendingStep, SeqResult, StepBatch, StepOutput
from engine.device_sampler import device_eligible, needs_filter, sample_step
from engine.kernels.cuda.graph_sampling import StaticSampler
from engine.request import SampledToken
from engine.sampler import plain_greedy

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


@dataclass
class _Bucket:
    rows: int
    qlen: int  # query tokens per row: 1 (decode) or 1 + k (verify; rows with fewer padded)
    dev: torch.Tensor  # [5 * rows * qlen + rows + rows * max_pages] int64 on the device
    host: torch.Tensor  # its pinned mirror on the host
    splits: int
    graph: object | None = None  # torch.cuda.CUDAGraph once captured
    logits: torch.Tensor | None = None  # [rows * qlen, vocab] float32, written by each replay
    sampler: StaticSampler | None = None  # plain decode buckets of a device-sampling engine

    def views(self, max_pages: int):
        """ids, positions, write slots [rows * qlen]; lengths [rows]; the written pages and their filled
        extents [rows * qlen] (page summaries, when sparse attention keeps them); page table [rows, max_pages]."""
        t, b, d = self.rows * self.qlen, self.rows, self.dev
        table = d[5 * t + b:].view(max_pages, b).t()  # column-major: the first P pages of all rows lead
        return d[:t], d[t:2 * t], d[2 * t:3 * t], d[3 * t:3 * t + b], d[3 * t + b:4 * t + b], d[4 * t + b:5 * t + b], table


class GraphDecode:
    def __init__(self, model, backend, page_size: int, max_batch: int, max_model_len: int, use_graphs: bool = True,
                 verify_len: int = 0, sampler: str = "cpu"):
        self.model, self.backend, self.page_size = model, backend, page_size
        self.sampler = sampler  # "device": eligible sampled rows drawn on the device (engine/device_sampler.py)
        self.device = model.device
        self.max_pages = -(-max_model_len // page_size)
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self.verify_len = verify_len  # 1 + the most drafts a verify row brings (0: no verify graphs)
        from engine.kernels.cuda import quest  # imports triton: only where it runs
        from engine.kernels.cuda.paged_attention import num_splits

        self._quest = quest

        sizes = [b for b in BUCKETS if b < max_batch] + [max_batch]
        kv_heads = backend.spec.num_kv_heads
        pin = self.device.type == "cuda"
        self.buckets: dict[tuple[int, int], _Bucket] = {}
        for qlen in [1] + ([verify_len] if verify_len > 1 else []):
            for b in sizes:
                n = 5 * b * qlen + b + b * self.max_pages
                self.buckets[b, qlen] = _Bucket(b, qlen, torch.zeros(n, dtype=torch.long, device=self.device),
                                                torch.zeros(n, dtype=torch.long, pin_memory=pin),
                                                num_splits(b, kv_heads, max_model_len, backend._sm_count))
                if qlen == 1 and sampler == "device":
                    self.buckets[b, qlen].sampler = StaticSampler(b, self.device, pin)
        self.max_rows = max_batch
        self.capture_s = 0.0
        self.sampler_error: str | None = None  # why sampling graphs were not captured (then run eagerly)
        self.pool = None
        self._copied = None  # CUDA event: the last upload from the pinned mirror finished
        self._ids_host = torch.zeros(max_batch, dtype=torch.long, pin_memory=pin)  # a step's greedy ids

    # ---- eligibility --------------------------------------------------------------------------
    def takes(self, batch: StepBatch) -> bool:
        """Plain decode rows (one token, logits at it); with verify graphs also verify rows (up to
        `verify_len` tokens, logits at each), each row's page table within the static width."""
        if batch.observe or batch.sparse or len(batch.seqs) > self.max_rows:
            return False
        qlen = self._qlen(batch)
        if not qlen:
            return False
        lens = [s.num_cached + qlen for s in batch.seqs]
        if self.backend.sparse is not None and not self._quest.fits(self.backend.sparse, lens, self.page_size,
                                                                    self.max_pages):
            return False  # a row below min_context reads all its pages: more than the static choice holds
        for s in batch.seqs:
            n = len(s.token_ids)
            if s.logits_at != list(range(n)) or (s.num_cached + qlen - 1) // self.page_size >= self.max_pages:
                return False
        return True

    def _qlen(self, batch: StepBatch) -> int:
        most = max(len(s.token_ids) for s in batch.seqs)
        return 1 if most == 1 else (self.verify_len if 1 < most <= self.verify_len else 0)

    # ---- the static step --------------------------------------------------------------------
    def _forward(self, bk: _Bucket) -> torch.Tensor:
        """The step the graph captures: [rows * qlen, vocab] float32 logits from the bucket's static inputs."""
        ids, pos, slots, lens, pages, extents, table = bk.views(self.max_pages)
        t = bk.rows * bk.qlen
        if self.backend.summaries is not None:  # the written pages' summaries, from the uploaded extents
            self.backend.summaries.use_plan(slots, pages, extents)
        group = AttnGroup(0, t, bk.rows, bk.qlen, [], [self.max_pages * self.page_size] * bk.rows, table, None,
                          False, lens=lens, splits=bk.splits, static=True)
        ctx = AttentionContext(slots, [group], self.model.scale)
        return self.model.logits(self.model.forward(ids, pos, ctx, self.backend))

    @torch.inference_mode()
    def capture(self) -> float:
        """Warm up every bucket (Triton compiles here) and, on CUDA, capture its graph; seconds taken."""
        t0 = time.perf_counter()
        for bk in sorted(self.buckets.values(), key=lambda x: -x.rows * x.qlen):  # largest first: one pool
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
            if bk.sampler is not None:  # its sampling graphs read this bucket's static logits
                try:
                    self.pool = bk.sampler.capture(bk.logits, self.pool)
                except RuntimeError as e:  # not capturable on this torch: the same pass runs eagerly
                    bk.sampler.graphs.clear()
                    self.sampler_error = f"{type(e).__name__}: {str(e)[:300]}"
        if self.use_graphs:
            torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - t0
        return self.capture_s

    def _pad(self, bk: _Bucket, n: int) -> None:
        """Rows n.. of the host mirror as padding: ids 0, positions 0, the scratch slot, length 0."""
        t, b, h = bk.rows * bk.qlen, bk.rows, bk.host
        q = bk.qlen
        h[n * q:t] = 0
        h[t + n * q:2 * t] = 0
        h[2 * t + n * q:3 * t] = self.backend.scratch_slot
        h[3 * t + n:3 * t + b] = 0
        # written pages and extents (refilled each step when summaries are kept): the scratch page, empty
        h[3 * t + b:4 * t + b], h[4 * t + b:5 * t + b] = self.backend.scratch_slot // self.page_size, 0

    def execute(self, batch: StepBatch) -> StepOutput:
        return self.launch(batch).wait()

    @torch.inference_mode()
    def launch(self, batch: StepBatch) -> PendingStep:
        """Fill the bucket's inputs, replay its graph; when every row is plain greedy, the argmax runs on
        the device and its ids start towards pinned host memory: the step returns before they arrive."""
        n, qlen = len(batch.seqs), self._qlen(batch)
        bk = self.buckets[min(b for b, q in self.buckets if b >= n and q == qlen), qlen]
        b, ps, t = bk.rows, self.page_size, bk.rows * qlen
        if self._copied is not None:  # the last step's upload must be done before its host rows change
            self._copied.synchronize()
        pages = max((s.num_cached + qlen - 1) // ps + 1 for s in batch.seqs)  # page-table columns in use
        h = bk.host.numpy()
        self._pad(bk, n)
        table = h[5 * t + b:5 * t + b + pages * b].reshape(pages, b)
        table[:] = 0
        if qlen == 1:  # plain decode: each field of every row in one assignment (the host's share of a step)
            seqs = batch.seqs
            h[0:n] = [s.token_ids[0] for s in seqs]
            h[t:t + n] = [s.position_start for s in seqs]
            h[2 * t:2 * t + n] = [s.pages[s.num_cached // ps] * ps + s.num_cached % ps for s in seqs]
            h[3 * t:3 * t + n] = [s.num_cached + 1 for s in seqs]
            for r, s in enumerate(seqs):
                used = s.num_cached // ps + 1
                table[:used, r] = s.pages[:used]
        else:
            self._fill_verify(h, table, batch, t, qlen, pages)
        if self.backend.summaries is not None:  # the host keeps the extents; the graph recomputes the pages
            written, ext = self.backend.summaries.plan_writes(h[2 * t:3 * t])
            h[3 * t + b:4 * t + b], h[4 * t + b:5 * t + b] = written, ext
        end = 5 * t + b + pages * b
        bk.dev[:end].copy_(bk.host[:end], non_blocking=True)
        on_device = self._device_sampled(batch, bk, qlen)  # None: the host samples (or all plain greedy)
        if on_device is not None:
            bk.sampler.fill(on_device)
            bk.sampler.upload()
        if self.use_graphs:
            self._copied = torch.cuda.Event()
            self._copied.record()
        if bk.graph is not None:
            bk.graph.replay()
            logits = bk.logits
        else:
            logits = self._forward(bk)
        if on_device is not None:
            chosen = bk.sampler.run(logits, any(needs_filter(r) for r in on_device))[:n]
        elif qlen > 1 or batch.return_logits or not all(s.sample is not None and plain_greedy(s.sample)
                                                        for s in batch.seqs):
            return PendingStep.done(StepOutput(self._results(batch, logits, qlen)))
        else:
            chosen = torch.max(logits[:n], dim=-1).indices
        ids = self._ids_host[:n]
        ids.copy_(chosen, non_blocking=True)
        done = None
        if self.use_graphs:
            done = torch.cuda.Event()
            done.record()

        def wait() -> StepOutput:
            if done is not None:
                done.synchronize()
            return StepOutput([SeqResult(s.request_id, SampledToken(t)) for s, t in zip(batch.seqs, ids.tolist())])
        return PendingStep(wait, overlaps=True)

    def _device_sampled(self, batch: StepBatch, bk: _Bucket, qlen: int) -> list | None:
        """The rows' sample requests when the bucket's sampler draws them all on the device (every row
        device-eligible, not all plain greedy: those keep their one argmax); else None."""
        reqs = [s.sample for s in batch.seqs]
        if self.sampler != "device" or bk.sampler is None or qlen > 1 or batch.return_logits \
                or any(r is None for r in reqs):
            return None
        if all(plain_greedy(r) for r in reqs) or not all(device_eligible(r) for r in reqs):
            return None
        return reqs

    def _fill_verify(self, h, table, batch: StepBatch, t: int, qlen: int, pages: int) -> None:
        """Host rows of a verify step: each row's tokens, positions and write slots, its unused queries as
        padding (the scratch slot), its length and pages."""
        ps = self.page_size
        for r, s in enumerate(batch.seqs):
            k, base = len(s.token_ids), r * qlen
            h[base + k:base + qlen], h[t + base + k:t + base + qlen] = 0, 0  # a verify row's unused queries
            h[2 * t + base + k:2 * t + base + qlen] = self.backend.scratch_slot
            h[base:base + k] = s.token_ids
            h[t + base:t + base + k] = range(s.position_start, s.position_start + k)
            h[2 * t + base:2 * t + base + k] = [s.pages[j // ps] * ps + j % ps
                                               for j in range(s.num_cached, s.num_cached + k)]
            # query qi sees keys [0, length - (qlen - 1 - qi)): the row's real queries see exactly their
            # causal prefix; padded queries (their K/V went to the scratch page) see more and are ignored
            h[3 * t + r] = s.num_cached + qlen
            used = min(len(s.pages), pages)
            table[:used, r] = s.pages[:used]

    def _results(self, batch: StepBatch, logits: torch.Tensor, qlen: int) -> list[SeqResult]:
        """logits: the bucket's [rows * qlen, vocab]; each row's logits rows copied out (the buffer is the
        next replay's), sampling rows sampled."""
        results = [SeqResult(s.request_id) for s in batch.seqs]
        if batch.return_logits:
            index = [r * qlen + j for r, s in enumerate(batch.seqs) for j in s.logits_at]
            picked = logits[torch.tensor(index, device=logits.device)] if qlen > 1 else logits[:len(index)].clone()
            at = 0
            for r, s in zip(results, batch.seqs):
                r.logits = picked[at:at + len(s.logits_at)]
                at += len(s.logits_at)
        rows = [i for i, s in enumerate(batch.seqs) if s.sample is not None]
        if rows:
            last = [i * qlen + batch.seqs[i].logits_at[-1] for i in rows]
            every = last == list(range(len(batch.seqs)))
            chosen = logits[:len(rows)] if every else logits[torch.tensor(last, device=logits.device)]
            tokens = sample_step(chosen, [batch.seqs[i].sample for i in rows], self.sampler)
            for i, tok in zip(rows, tokens):
                results[i].sampled = tok
        return results

MODES = ("auto", "static", "off")


def attach(runner, max_num_seqs: int, max_model_len: int, mode: str = "auto", verify_len: int = 0
           ) -> GraphDecode | None:
    """Give `runner` static-shape decode steps where they run: "auto" captures CUDA graphs on CUDA when
    attention takes the Triton path; "static" runs the same static step eagerly (any device: the CPU tests,
    or an eager comparison on the GPU); "off" (or a model or KV format the step does not cover) keeps every
    step eager. `verify_len` (1 + the speculative config's most drafts): verify steps get graphs too, rows
    with fewer drafts padded. Captures at once (the Triton compiles too) and records the seconds in
    `capture_s`."""
    from engine.errors import InvalidRequestError
    from engine.kv_cache.backend import RawKVBackend
    from engine.kv_cache.quantized import QuantizedKVBackend

    if mode not in MODES:
        raise InvalidRequestError("decode_graphs", f"{mode!r} is not one of {', '.join(MODES)}")
    model, backend = runner.model, runner.backend
    whole = model.is_first and model.is_last and model.all_reduce is None
    plain_pages = type(backend) in (RawKVBackend, QuantizedKVBackend) and backend.triton_paged
    windowed = model.cfg.sliding_window is not None or model.cfg.local_window is not None
    if mode == "off" or not whole or not plain_pages or windowed:
        return None
    if mode == "auto" and model.device.type != "cuda":
        return None
    graphs = GraphDecode(model, backend, runner.page_size, max_num_seqs, max_model_len, use_graphs=mode == "auto",
                         verify_len=verify_len, sampler=runner.sampler)
    graphs.capture()
    runner.graphs = graphs
    return graphs
