"""Whole-design checks for bench/repro/splitwise/repro.py --verify: a design's machines simulated together.

The per-machine goodputs that size a design measure each phase alone on its own bounds (a prompt pool on
the TTFT ones, a token pool on the TBT ones); the end-to-end bounds (P50 <= 1.25x!) need both phases, and so
do the KV transfers between them. Here the chosen design runs as one cluster -- prompt pool -> KV over the
machines' link -> token pool (with the artifact: machines change role under load), or n colocated
machines -- every request held to all nine bounds, and the rate is searched from the sizing's figure to the
highest that meets them.

    verify_planner   the planner's latency models and plan simulation (`pool_placement.simulate_plan`)
    artifact_run     one design point as the artifact runs it: its tables, memory and batching (whole
                     prompts in batches of 2048 tokens), its schedulers (token_jsq; Splitwise's prompt,
                     token and mixed pools: `mixed_pool`), each prompt's KV moved whole after it
    verify_artifact  its highest rate meeting every bound; better_split: and the neighbouring splits
Pure Python.
"""
from __future__ import annotations

from dataclasses import replace

from bench.repro.splitwise.baseline import ArtifactSetup
from bench.repro.splitwise.designs import DESIGNS, GPUS, MACHINES, MAX_LEN, machine_latency, machine_numbers
from bench.repro.splitwise.mixed_pool import simulate_mixed_pool
from bench.repro.splitwise.step_table import TableMemory
from cluster.planner.inputs.hardware import load_hardware
from cluster.planner.inputs.workload import poisson_requests
from cluster.planner.latency.base import Parallel
from cluster.planner.search.configs import instance_memory
from cluster.planner.search.goodput import bisect_rate
from cluster.planner.search.request import PlanRequest
from cluster.planner.sim.coloc import simulate_colocated
from cluster.planner.sim.disagg import Link
from cluster.planner.sim.metrics import SimResult

REQUESTS = 3000  # per probe: ~30 s of a 100 req/s cluster, enough for a P99 over requests
ARTIFACT_SECONDS = 600.0  # the artifact's traces run 10 minutes (generate_trace.py): a queue near saturation
                          # grows with the run, so a shorter one would pass rates the artifact fails
MAX_SEQS = 256


def _link_bw(prompt: str, token: str) -> float:
    return min(load_hardware(MACHINES[prompt]).inter_node_bw, load_hardware(MACHINES[token]).inter_node_bw) * GPUS


def verify_planner(model, pairs, slo, design: str, a: int, b: int, rate: float, budget_of: dict) -> float:
    """The whole plan simulated at `rate`; the highest rate (5% steps down) meeting the SLO."""
    from cluster.planner.search.plans import PhaseChoice, Plan
    from cluster.planner.search.pool_placement import simulate_plan

    prompt, token = DESIGNS[design]
    hws = tuple(load_hardware(MACHINES[m]) for m in MACHINES)
    req = PlanRequest(model, hws[0], 64, GPUS, tuple(pairs), rate, slo, max_len=MAX_LEN, types=hws)

    def choice(machine, kind, budget):
        hw = load_hardware(MACHINES[machine])
        kv = instance_memory(model, hw, Parallel(GPUS, 1)).kv_tokens
        return PhaseChoice(kind, Parallel(GPUS, 1), budget, kv, MAX_SEQS, 1.0, "", hw.name)

    if prompt is None:
        plan = Plan("colocated", "colocated", ((choice(token, "colocated", budget_of[(token, "colocated")]), a),),
                    a * GPUS)
    else:
        p, d = choice(prompt, "prefill", budget_of[(prompt, "prefill")]), choice(token, "decode", 0)
        plan = Plan("disaggregated", "cross-type", ((p, a), (d, b)), (a + b) * GPUS, _link_bw(prompt, token))
    while rate > 0.05:
        if simulate_plan(replace(req, rate=rate), plan, rate).attainment(slo) >= slo.attainment:
            return rate
        rate *= 0.95
    return 0.0


def artifact_run(model, pairs, design: str, a: int, b: int, rate: float, seconds: float = ARTIFACT_SECONDS,
                 seed: int = 0) -> SimResult:
    """One run of the design's a prompt + b token machines (colocated: a machines) as the artifact runs it:
    its tables, memory and batching (whole prompts, 2048 batch tokens), its schedulers (token_jsq for the
    baselines, mixed_pool for Splitwise), Poisson arrivals at `rate` for `seconds` (at least REQUESTS)."""
    prompt, token = DESIGNS[design]
    mem = TableMemory.load(model.name)  # (the same on every machine: 8 x 80 GiB)
    requests = poisson_requests(pairs, rate, max(REQUESTS, int(rate * seconds)), seed)

    def machines(kind: str, n: int, route: str = "outstanding") -> list[ArtifactSetup]:
        return [ArtifactSetup(machine_latency(model, kind, "artifact"), mem.kv_tokens, 2048, MAX_SEQS, True, route)] * n

    if prompt is None:
        return simulate_colocated(requests, machines(token, a, "prompts"))
    link = Link(mem.kv_bytes_per_token, mem.link_bytes_per_s, 1)
    return simulate_mixed_pool(requests, machines(prompt, a), machines(token, b), link)


def verify_artifact(model, pairs, slo, design: str, a: int, b: int, rate: float, seed: int = 0) -> float:
    """`artifact_run`'s highest rate meeting every bound, bisected to 3% from `rate` (the sizing's figure)."""
    return bisect_rate(lambda r: artifact_run(model, pairs, design, a, b, r, seed=seed).attainment(slo),
                       slo.attainment, rate, rel_tol=0.03, warm=True)[0]


def better_split(model, pairs, slo, design: str, a: int, b: int, rate: float, limit: float, by: int,
                 seed: int = 0) -> tuple[float, int, int]:
    """From a split (a prompt, b token machines) verified at `rate`: move prompt machines a step at a time
    (the artifact sweeps splits in steps of 5 of its 40-86 machines), the token side refilled to the
    budget (`limit` in cost, by=0, or power, by=1), while the moved split meets every bound 3% higher up;
    (rate, a, b) of the best. Colocated designs stay as they are."""
    prompt, token = DESIGNS[design]
    if prompt is None:
        return rate, a, b
    pp, tp = machine_numbers(prompt)[by], machine_numbers(token)[by]
    step = max(1, round((a + b) / 14))
    for move in (step, -step):
        n = a + move
        while n >= 1:
            m = int((limit - n * pp) / tp + 1e-9)
            if m < 1 or artifact_run(model, pairs, design, n, m, rate * 1.03, seed=seed).attainment(slo) < \
                    slo.attainment:
                break
            rate, a, b = verify_artifact(model, pairs, slo, design, n, m, rate * 1.03, seed), n, m
            n += move
    return rate, a, b
