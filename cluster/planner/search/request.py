"""What the search is asked: `PlanRequest` (model, hardware, GPUs, workload lengths, rate, SLO, profile).

Its own module so the search's parts (`plan_search`, `pool_placement`, `kv_link`, `designs`) all import it
from below instead of from each other. Pure Python.
"""
from __future__ import annotations

from dataclasses import dataclass

from cluster.planner.inputs.hardware import Hardware
from cluster.planner.inputs.models import ModelSpec
from cluster.planner.latency.profiles import Profile
from cluster.planner.sim.metrics import SLO


@dataclass(frozen=True)
class PlanRequest:
    model: ModelSpec
    hw: Hardware
    nodes: int
    gpus_per_node: int
    pairs: tuple[tuple[int, int], ...]  # (input, output) lengths to sample, clamped to max_len
    rate: float  # req/s the plan must sustain
    slo: SLO
    dtype: str = "bfloat16"
    profile: Profile | None = None
    max_len: int = 0  # 0: the model's max positions (capped at 32k for the KV fit test)
    prefill_budgets: tuple[int, ...] = ()  # () : hardware defaults (see `budgets`)
    coloc_budgets: tuple[int, ...] = ()
    top_k: int = 2
    verify_per_mode: int = 2
    seed: int = 0
    types: tuple[Hardware, ...] = ()  # every machine type of a heterogeneous search (`designs`); () : hw only

    def hw_of(self, name: str) -> Hardware:
        """The hardware a phase choice names ("" : this request's `hw`)."""
        return next((h for h in self.types if h.name == name), self.hw) if name else self.hw

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def model_len(self) -> int:
        return self.max_len or min(self.model.max_positions, 32768)

    def budgets(self) -> tuple[tuple[int, ...], tuple[int, ...], int, int]:
        """Prefill budgets, colocated budgets, prefill max seqs, decode/colocated max seqs."""
        if self.hw.is_cpu:  # the engine's defaults on one core (deploy/local.yaml)
            return self.prefill_budgets or (512,), self.coloc_budgets or (512,), 8, 32
        return self.prefill_budgets or (2048, 8192), self.coloc_budgets or (512, 2048, 8192), 256, 256
