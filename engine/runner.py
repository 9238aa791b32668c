"""`ModelRunner`: executes one `StepBatch` on a model over a KV backend and returns a `StepOutput`.

Stateless about requests: page tables and slot counts come in the batch (the scheduler owns them). One
forward over the packed ragged batch, logits only at the rows asked for, then sampling. Hooks registered
with `add_layer_hook` run after each layer (layer-wise KV publishing); attention observation is opt-in per
request through `StepBatch.observe`. A pipeline stage (engine/parallel) calls the two halves itself:
`run_layers` (its layers, given the previous stage's hidden states) and, on the last stage, `finish`.
"""
from __future__ import annotations

from typing import Callable

import torch

from engine.attention_context import AttentionContext, SeqLayout, build_context
from engine.batch import PendingStep, SeqResult, StepBatch, StepOutput
from engine.model import LlamaForward  # or engine.gemma.GemmaForward, its subclass
from engine.device_sampler import resolve as resolve_sampler, sample_step

LayerHook = Callable[[int, StepBatch], None]


class ModelRunner:
    def __init__(self, model: LlamaForward, backend, page_size: int, sampler: str = "cpu"):
        self.model = model
        self.sampler = resolve_sampler(sampler, model.device)  # "device" | "cpu" (engine/device_sampler.py)
        self.backend = backend
        self.page_size = page_size
        self.device = model.device
        self._layer_hooks: list[LayerHook] = []
        self.graphs = None  # engine/kernels/cuda/graph_decode.GraphDecode: plain decode steps at static shapes

    def add_layer_hook(self, hook: LayerHook) -> None:
        self._layer_hooks.append(hook)

    def remove_layer_hook(self, hook: LayerHook) -> None:
        self._layer_hooks.remove(hook)

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> StepOutput:
        return self.launch(batch).wait()

    @torch.inference_mode()
    def launch(self, batch: StepBatch) -> PendingStep:
        """Start the step; a static-shape decode step returns before its sampled ids are read (the engine
        detokenizes the previous step meanwhile), any other step returns done."""
        if self.graphs is not None and not self._layer_hooks and self.graphs.takes(batch):
            return self.graphs.launch(batch)
        return PendingStep.done(self.finish(batch, *self.run_layers(batch)))

    @torch.inference_mode()
    def run_layers(self, batch: StepBatch, hidden: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, list[int], AttentionContext]:
        """The model's layers over the packed batch: (hidden [num_tokens, hidden], packed rows that want
        logits, context). A pipeline stage after the first passes the previous stage's `hidden`."""
        assert batch.seqs, "empty step batch"
        ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []  # packed row of every requested logits position
        for s in batch.seqs:
            base = len(ids)
            ids.extend(s.token_ids)
            positions.extend(range(s.position_start, s.position_start + len(s.token_ids)))
            rows.extend(base + i for i in s.logits_at)
        layouts = [SeqLayout(s.request_id, len(s.token_ids), s.num_cached, s.pages) for s in batch.seqs]
        ctx = build_context(layouts, self.page_size, self.model.scale, self.device,
                            self.model.cfg.sliding_window, batch.observe,
                            bucket_decode=not getattr(self.backend, "ragged_decode", False), sparse=batch.sparse,
                            local_window=self.model.cfg.local_window)
        hook = None
        if self._layer_hooks:
            def hook(layer: int) -> None:
                for h in self._layer_hooks:
                    h(layer, batch)
        dev = self.device
        hidden = self.model.forward(torch.tensor(ids, dtype=torch.long, device=dev),
                                    torch.tensor(positions, dtype=torch.long, device=dev), ctx, self.backend, hook,
                                    hidden)
        return hidden, rows, ctx

    @torch.inference_mode()
    def finish(self, batch: StepBatch, hidden: torch.Tensor, rows: list[int], ctx: AttentionContext) -> StepOutput:
        """Logits at the asked-for rows of the final hidden states, then sampling."""
        dev = self.device
        if rows and rows != list(range(hidden.shape[0])):  # (plain decode wants every row: no gather)
            hidden = hidden[torch.tensor(rows, dtype=torch.long, device=dev)]
        logits = self.model.logits(hidden) if rows else None
        return StepOutput(self._results(batch, logits), ctx.observations)

    def _results(self, batch: StepBatch, logits: torch.Tensor | None) -> list[SeqResult]:
        results, offset = [], 0
        sample_rows, sample_reqs, sample_idx = [], [], []
        for i, s in enumerate(batch.seqs):
            n = len(s.logits_at)
            r = SeqResult(s.request_id)
            if batch.return_logits and n:
                r.logits = logits[offset:offset + n]
            if s.sample is not None:
                assert n, f"{s.request_id}: sampling needs a logits position"
                sample_rows.append(offset + n - 1)
                sample_reqs.append(s.sample)
                sample_idx.append(i)
            offset += n
            results.append(r)
        if sample_reqs:
            # every logits row sampled, in order (plain decode): no [n, vocab] copy (3 MB at batch 16)
            every = sample_rows == list(range(logits.shape[0]))
            tokens = sample_step(logits if every else logits[sample_rows], sample_reqs, self.sampler)
            for i, t in zip(sample_idx, tokens):
                results[i].sampled = t
        return results
