"""Splitwise's machines and designs, and the search over machine counts, for bench/repro/splitwise/repro.py.

    MACHINES, DESIGNS       the paper's machine types (deploy/hardware.yaml splitwise-*) and its six designs
    machine_latency         one TP-8 instance's latency model: the planner's, or the artifact's tables
    machine_numbers, spend  $/h and W of a machine, of a design's machines
    PoolGoodput             per-machine goodput of a pool of n (measured at a few pool sizes, interpolated)
    best_within, least_for  the best split within a cost/power budget; the cheapest split for a rate
Pure Python; no simulation here (repro measures, verify checks whole designs).
"""
from __future__ import annotations

import math
from pathlib import Path

from bench.repro.splitwise.step_table import StepTable, TableLatency
from cluster.planner.inputs.hardware import load_hardware
from cluster.planner.latency.base import Parallel
from cluster.planner.latency.profiles import latency_model

WORKLOADS = Path(__file__).resolve().parents[3] / "data" / "workloads"
MACHINES = {"A100": "splitwise-a100", "H100": "splitwise-h100", "H100cap": "splitwise-h100cap"}
DESIGNS = {"Baseline-A100": (None, "A100"), "Baseline-H100": (None, "H100"), "Splitwise-AA": ("A100", "A100"),
           "Splitwise-HH": ("H100", "H100"), "Splitwise-HA": ("H100", "A100"), "Splitwise-HHcap": ("H100", "H100cap")}
GPUS = 8  # one DGX machine = one TP-8 instance
MAX_LEN = 8192


def machine_latency(model, machine: str, perf: str):
    """One TP-8 instance's latency model: the planner's for the machine's hardware entry ("planner"), or
    the artifact's measured iteration times (deploy/profiles/splitwise-perf-model.yaml, "artifact")."""
    if perf == "artifact":
        return TableLatency(StepTable.load(model.name, MACHINES[machine]))
    return latency_model(model, load_hardware(MACHINES[machine]), Parallel(GPUS, 1))


class PoolGoodput:
    """Per-instance goodput of a pool of n machines of one kind: measured with each of `pools` machines
    behind the router (least queued work, as the artifact's JSQ schedulers), interpolated in log2(n)
    between them and held beyond the ends. Why: under a P99 bound a pool of n takes more than n times
    one machine's rate, since a request finds the least loaded machine."""

    def __init__(self, by_pool: dict[int, dict[tuple[str, str], float]]):
        self.by_pool = dict(sorted(by_pool.items()))

    def __call__(self, key: tuple[str, str], n: int) -> float:
        ks = list(self.by_pool)
        if n <= ks[0] or len(ks) == 1:
            return self.by_pool[ks[0]][key]
        if n >= ks[-1]:
            return self.by_pool[ks[-1]][key]
        hi = next(k for k in ks if k >= n)
        lo = ks[ks.index(hi) - 1]
        w = (math.log2(n) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
        return (1 - w) * self.by_pool[lo][key] + w * self.by_pool[hi][key]

    def total(self, key: tuple[str, str], n: int) -> float:
        return n * self(key, n) if n > 0 else 0.0


def machine_numbers(machine: str) -> tuple[float, float]:
    hw = load_hardware(MACHINES[machine])
    return hw.price_per_hour * GPUS, hw.tdp_w * GPUS  # $/h and W per machine


def best_within(design: str, g: PoolGoodput, limit: float, by: int) -> tuple[float, int, int]:
    """(throughput, prompt machines, token machines) with the most throughput whose cost (by=0) or power
    (by=1) fits `limit`; colocated designs report (n, 0)."""
    prompt, token = DESIGNS[design]
    if prompt is None:
        per = machine_numbers(token)[by]
        n = int(limit / per + 1e-9)  # (a budget of exactly n machines' cost must buy n, not n - 1)
        return g.total((token, "colocated"), n), n, 0
    pp, tp = machine_numbers(prompt)[by], machine_numbers(token)[by]
    best = (0.0, 0, 0)
    for a in range(1, int(limit / pp + 1e-9) + 1):
        b = int((limit - a * pp) / tp + 1e-9)
        if b < 1:
            continue
        thr = min(g.total((prompt, "prefill"), a), g.total((token, "decode"), b))
        if thr > best[0]:
            best = (thr, a, b)
    return best


def fewest(g: PoolGoodput, key: tuple[str, str], target: float) -> int:
    n = 1
    while g.total(key, n) < target - 1e-9:
        if g(key, n) <= 0 or n > 100_000:
            raise ValueError(f"{key} cannot reach {target:.2f} req/s")
        n += 1
    return n


def least_for(design: str, g: PoolGoodput, target: float, by: int) -> tuple[float, int, int]:
    """(cost or power, prompt machines, token machines) of the cheapest split serving `target` req/s."""
    prompt, token = DESIGNS[design]
    if prompt is None:
        n = fewest(g, (token, "colocated"), target)
        return n * machine_numbers(token)[by], n, 0
    a, b = fewest(g, (prompt, "prefill"), target), fewest(g, (token, "decode"), target)
    return a * machine_numbers(prompt)[by] + b * machine_numbers(token)[by], a, b


def spend(design: str, split: tuple[float, int, int], by: int = 0) -> float:
    """$/h (by=0) or W (by=1) of a design's machines."""
    prompt, token = DESIGNS[design]
    _, a, b = split
    return a * machine_numbers(token if prompt is None else prompt)[by] + (b * machine_numbers(token)[by] if prompt else 0)
