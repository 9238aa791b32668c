"""The planner's search on small synthetic models and profiles: picks the obviously better plan, respects
memory, rejects TP that does not divide the heads, and names the closest option when nothing works."""
from __future__ import annotations

import pytest

from cluster.planner.errors import InfeasibleSLOError, NoFeasibleConfigError
from cluster.planner.inputs.hardware import Hardware
from cluster.planner.inputs.models import ModelSpec
from cluster.planner.latency.base import Coeffs, Parallel
from cluster.planner.latency.profiles import Profile
from cluster.planner.search.configs import head_problem, instance_configs
from cluster.planner.search.plan_search import search
from cluster.planner.search.request import PlanRequest
from cluster.planner.sim.metrics import SLO

TINY = ModelSpec("tiny", layers=4, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=100,
                 max_positions=2048, params=1e6)  # 2 MB of bf16 weights, 512 B of KV per token
MB = 1e6


def hw(memory: float = 1e9) -> Hardware:
    return Hardware("synthetic", 1e12, 1e11, memory, 1e11, 1e10, 1e9)


def profile(tp2_speedup: float = 4.0) -> Profile:
    """TP 1: 20 ms per 100-token prompt (no intercept, so batching does not help); TP 2 `tp2_speedup`x
    faster. Decode: 10 ms per step at any batch."""
    return Profile("synthetic", "tiny", "bfloat16", "synthetic", {
        1: Coeffs((0.0, 2e-4, 0.0), (0.01, 0.0, 0.0)),
        2: Coeffs((0.0, 2e-4 / tp2_speedup, 0.0), (0.01, 0.0, 0.0))})


def request(rate: float, slo=SLO(0.1, 0.05, 0.9), memory: float = 1e9, nodes: int = 2, per_node: int = 2,
            **kw) -> PlanRequest:
    return PlanRequest(TINY, hw(memory), nodes, per_node, ((100, 10),), rate, slo, profile=profile(),
                       max_len=2048, prefill_budgets=(2048,), coloc_budgets=(512,), **kw)


def test_picks_the_obviously_better_tensor_parallel_degree():
    res = search(request(rate=150))
    best = res.best
    assert best.attainment >= 0.9
    prompt_pools = [c for c, _ in best.pools if c.phase in ("prefill", "colocated")]
    assert prompt_pools and all(c.parallel.tp == 2 for c in prompt_pools), best.describe()
    # TP 1 needs >= 4 prefill GPUs for 150 req/s (50 req/s each at most) and does not fit in 4
    assert best.gpus <= 4
    assert {c.phase for c in res.phases} == {"prefill", "decode", "colocated"}


def test_respects_memory():
    # 3.2 MB devices: TP 1 holds 2 MB of weights and KV for < 2048 tokens; TP 2 fits
    configs, rejected = instance_configs(TINY, hw(3.2 * MB), "bfloat16", 2, 4, 2048)
    assert configs and all(c.parallel.tp * c.parallel.pp >= 2 for c in configs)
    assert any(r.startswith("tp1pp1") and "< one 2048-token sequence" in r for r in rejected)
    res = search(request(rate=20, memory=3.2 * MB))
    assert all(c.parallel.gpus >= 2 for p in res.plans for c, _ in p.pools)


def test_rejects_tensor_parallel_that_does_not_divide_heads():
    six = ModelSpec("six", 4, 96, 6, 2, 16, 128, 100, 2048, 1e6)
    configs, rejected = instance_configs(six, hw(), "bfloat16", 4, 8, 2048)
    assert {c.parallel.tp for c in configs} == {1, 2}
    assert "tp 4 does not divide 6 attention heads" in rejected
    assert head_problem(TINY, 4) is None  # 4 KV-head replicas over 2 KV heads: allowed
    odd = ModelSpec("odd", 4, 96, 6, 3, 16, 128, 100, 2048, 1e6)
    assert "neither divides nor is a multiple of 3 KV heads" in head_problem(odd, 2)


def test_model_that_fits_nowhere_names_the_smallest_deployment():
    with pytest.raises(NoFeasibleConfigError, match=r"fits no TP x PP.*closest feasible: the smallest instance "
                                                    r"that fits is tp\dpp\d \(\d GPUs\)"):
        search(request(rate=1, memory=2.0 * MB, nodes=1, per_node=1))


def test_impossible_slo_names_the_closest_target():
    with pytest.raises(InfeasibleSLOError, match=r"even at low load; closest feasible: --ttft-ms \d+"):
        search(request(rate=1, slo=SLO(0.001, 0.05, 0.9)))
    with pytest.raises(InfeasibleSLOError, match=r"--tpot-ms \d+"):
        search(request(rate=1, slo=SLO(0.1, 0.001, 0.9)))


def test_rate_beyond_the_gpus_names_the_rate_they_sustain():
    with pytest.raises(InfeasibleSLOError, match=r"needs about \d+ GPUs.*closest feasible: --rate [\d.]+ on 4 "
                                                 r"GPUs, or --nodes \d+"):
        search(request(rate=5000))


def test_co_node_placement_is_considered_with_several_nodes_and_slow_links():
    slow = Hardware("slow-net", 1e12, 1e11, 1e9, 1e11, 1e10, 1e3)  # 1 KB/s between nodes
    req = PlanRequest(TINY, slow, 2, 2, ((100, 10),), 50, SLO(0.1, 0.05, 0.9), profile=profile(),
                      max_len=2048, prefill_budgets=(2048,), coloc_budgets=(512,))
    res = search(req)
    assert any(p.placement == "co-node" for p in res.plans)
    assert res.best.placement != "independent"  # KV across 1 KB/s links never meets the TPOT target
    assert Parallel(1, 1).gpus == 1
