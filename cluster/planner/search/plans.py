"""What the search returns: phase choices (one instance configuration with its goodput) and plans.

    PhaseChoice   one instance kind (prefill, decode or colocated): TP x PP, token budget, KV capacity,
                  goodput (req/s per instance at the SLO attainment) and which SLO binds it
    Plan          a whole deployment: mode, placement, instances per pool, GPUs, predicted goodput,
                  and (after the whole-plan check) the simulated attainment and percentiles at the rate
Plain frozen dataclasses: `search` builds them, `report` and `spec_writer` read them. Pure Python.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from cluster.planner.latency.base import Parallel
from cluster.planner.sim.metrics import SimResult


@dataclass(frozen=True)
class PhaseChoice:
    phase: str  # prefill | decode | colocated
    parallel: Parallel
    token_budget: int
    kv_tokens: int
    max_seqs: int
    goodput: float  # req/s of one instance
    binding: str = ""  # ttft | tpot: the target that fails first just above the goodput; throughput: capped
    hardware: str = ""  # the device it runs on (a `Hardware.name`); "": the request's one hardware type

    @property
    def per_gpu(self) -> float:
        return self.goodput / self.parallel.gpus

    def describe(self) -> str:
        return (f"{self.phase} {self.parallel} budget {self.token_budget}: {self.goodput:.2f} req/s "
                f"({self.per_gpu:.2f}/GPU)")


@dataclass(frozen=True)
class Plan:
    mode: str  # disaggregated | colocated
    placement: str  # independent (pools anywhere) | co-node (a stage's prefill and decode share a node) | colocated
    pools: tuple[tuple[PhaseChoice, int], ...]  # (instance kind, replicas)
    gpus: int
    link_bw: float = 0.0  # bytes/s a KV transfer gets (disaggregated)
    attainment: float | None = None  # simulated at the target rate (None: not checked)
    result: SimResult | None = field(default=None, compare=False, repr=False)

    @property
    def goodput(self) -> float:
        """Predicted rate the plan sustains: its slowest pool."""
        return min(c.goodput * n for c, n in self.pools)

    @property
    def per_gpu_goodput(self) -> float:
        return self.goodput / self.gpus

    @property
    def ideal_per_gpu_goodput(self) -> float:
        """Per-GPU goodput at the best fractional ratio (1 / sum of GPU-seconds per request)."""
        return 1.0 / sum(c.parallel.gpus / c.goodput for c, _ in self.pools)

    def pool(self, phase: str) -> tuple[PhaseChoice, int] | None:
        return next(((c, n) for c, n in self.pools if c.phase == phase), None)

    def describe(self) -> str:
        pools = " + ".join(f"{n}x {c.phase} {c.parallel}" + (f"/b{c.token_budget}" if c.phase != "decode" else "")
                           + (f" on {c.hardware}" if c.hardware else "") for c, n in self.pools)
        return f"{self.mode} [{self.placement}] {pools} = {self.gpus} GPUs"
