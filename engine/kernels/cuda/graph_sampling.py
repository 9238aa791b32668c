"""The device sampler at a decode bucket's static shapes: parameters uploaded before replay, sampling
captured in CUDA graphs of its own (engine/device_sampler.py has the math and the reasons).

Who calls it: `GraphDecode` (graph_decode.py) gives each plain-decode bucket one `StaticSampler` when the
engine samples on the device. A step whose rows are all `device_eligible` (some sampled, not all plain
greedy): `fill(reqs)` writes the rows' parameters into the pinned mirror, `upload()` starts their one
non-blocking copy beside the step's inputs, and after the forward's replay `run(logits, filtered)`
replays the sampling graph of that variant (or, without graphs, runs the same `sample_rows` eagerly) and
returns the bucket's [rows] int64 ids on the device; only the first n of them go to the host.

Two graphs per bucket, captured after its forward graph on the same memory pool: `filtered` (one sort per
row: some row has min-p, top-k or top-p) and plain (temperature only, no sort), so a step that filters
nothing never pays for the sort. A row's token is the same under either. The forward graph stays
sampling-free: all-greedy steps keep their one argmax.
"""
from __future__ import annotations

import torch

from engine.device_sampler import FIELDS, pack_params, sample_rows
from engine.sampler import SampleRequest


class StaticSampler:
    def __init__(self, rows: int, device: torch.device, pin: bool):
        self.rows = rows
        self.host = torch.zeros(FIELDS, rows, dtype=torch.float64, pin_memory=pin)  # [FIELDS, rows]
        self.dev = torch.zeros(FIELDS, rows, dtype=torch.float64, device=device)
        self.graphs: dict[bool, object] = {}  # filtered -> torch.cuda.CUDAGraph
        self.ids: dict[bool, torch.Tensor] = {}  # filtered -> [rows] int64, written by that graph's replay

    def fill(self, reqs: list[SampleRequest]) -> None:
        """Rows 0..n-1 from `reqs`; the rest greedy (padding: their ids are never read)."""
        pack_params(reqs, self.host.numpy())

    def upload(self) -> None:
        self.dev.copy_(self.host, non_blocking=True)

    def capture(self, logits: torch.Tensor, pool) -> object:
        """Capture both variants over `logits` (the forward graph's static [rows, vocab] output); the pool."""
        dev = logits.device
        for filtered in (True, False):
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up outside the capture (allocator, sort workspace)
                    sample_rows(logits, self.dev, filtered)
            torch.cuda.current_stream(dev).wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.ids[filtered] = sample_rows(logits, self.dev, filtered)
            self.graphs[filtered] = g
            pool = g.pool()
        return pool

    def run(self, logits: torch.Tensor, filtered: bool) -> torch.Tensor:
        """[rows] int64 ids on the device: the captured graph of this variant, or the same math eagerly."""
        g = self.graphs.get(filtered)
        if g is None:
            return sample_rows(logits, self.dev, filtered)
        g.replay()
        return self.ids[filtered]
