"""The planner's simulators against closed forms: one request's latency is the latency model's; an
M/D/1 queue's mean wait at moderate load; closed-form step runs equal step-by-step sums; KV limits."""
from __future__ import annotations

import random

import pytest

from cluster.planner.inputs.workload import Request, poisson_requests
from cluster.planner.latency.base import Coeffs, FittedLatency, Parallel
from cluster.planner.latency.stepping import StepRun
from cluster.planner.sim.coloc import ColocSetup, simulate_colocated
from cluster.planner.sim.disagg import DecodeSetup, Link, PrefillSetup, simulate_decode_only, simulate_disaggregated
from cluster.planner.sim.metrics import SLO
from cluster.stats import percentile

COEFFS = Coeffs(prefill=(0.010, 2e-5, 1e-9), decode=(0.008, 1e-7, 2e-4))
FAST_LINK = Link(kv_bytes_per_token=1000.0, bandwidth=1e12, layers=10)


def model(pp: int = 1) -> FittedLatency:
    return FittedLatency(Parallel(1, pp), COEFFS)


def decode_sum(m, l: int, out: int) -> float:
    return sum(m.decode(1, l + 1 + j) for j in range(out - 1))


def test_single_request_disaggregated_equals_the_latency_model():
    m, l, out = model(), 700, 50
    link = Link(kv_bytes_per_token=1000.0, bandwidth=1e8, layers=10)  # 7 ms of KV, the prefill takes ~25 ms
    r = simulate_disaggregated([Request(1.0, l, out)], [PrefillSetup(m)], [DecodeSetup(m, 10_000)], link).results[0]
    prefill = COEFFS.prefill[0] + COEFFS.prefill[1] * l + COEFFS.prefill[2] * l * l
    xfer = l * 1000.0 / 1e8
    tail = max(xfer / 10, xfer - prefill)
    assert r.ttft == pytest.approx(prefill)
    assert r.e2e == pytest.approx(prefill + tail + decode_sum(m, l, out))
    assert r.tpot == pytest.approx((tail + decode_sum(m, l, out)) / (out - 1))


def test_router_counts_running_prompts_not_only_queued_ones():
    """A prompt arriving while the first instance runs a batch (its queue empty) goes to the idle second
    instance and starts at once, as the real router's queued_tokens (submitted, first token not back)."""
    m = model()
    reqs = [Request(0.0, 4000, 1), Request(0.001, 100, 1)]
    r = simulate_disaggregated(reqs, [PrefillSetup(m), PrefillSetup(m)], [DecodeSetup(m, 100_000)], FAST_LINK).results
    alone = COEFFS.prefill[0] + COEFFS.prefill[1] * 100 + COEFFS.prefill[2] * 100 * 100
    assert r[1].ttft == pytest.approx(alone)


def test_slow_link_adds_what_does_not_overlap_compute():
    m, l = model(), 700
    slow = Link(kv_bytes_per_token=1000.0, bandwidth=1e6, layers=10)  # 0.7 s of KV: mostly not hidden
    r = simulate_disaggregated([Request(0.0, l, 2)], [PrefillSetup(m)], [DecodeSetup(m, 10_000)], slow).results[0]
    assert r.e2e - r.ttft == pytest.approx(0.7 - r.ttft + m.decode(1, l + 1))


def test_single_request_colocated_chunks_sum_to_the_whole_prompt():
    m, l, out = model(), 1000, 20
    r = simulate_colocated([Request(0.0, l, out)], [ColocSetup(m, 10_000, token_budget=256)]).results[0]
    chunks = [(0, 256), (256, 256), (512, 256), (768, 232)]
    assert r.ttft == pytest.approx(sum(m.prefill(c, c * (2 * p + c)) for p, c in chunks))
    assert r.e2e == pytest.approx(r.ttft + decode_sum(m, l, out))


def test_pipeline_parallel_prefill_pipelines_batches():
    m = model(pp=4)
    reqs = [Request(0.0, 1000, 1), Request(0.0, 1000, 1)]
    res = simulate_disaggregated(reqs, [PrefillSetup(m, token_budget=1000)], [DecodeSetup(m, 10_000)], FAST_LINK)
    one = m.prefill(1000, 1e6)
    assert res.results[0].ttft == pytest.approx(one)
    assert res.results[1].ttft == pytest.approx(m.prefill_interval(1000, 1e6) + one)  # not 2x one


def test_md1_mean_wait_at_moderate_load():
    """Poisson arrivals, fixed service D, one server: mean wait rho*D / (2(1 - rho))."""
    m, l = model(), 500
    d = m.prefill(l, l * l)
    rho = 0.5
    reqs = poisson_requests([(l, 1)], rho / d, 40_000, seed=7)
    res = simulate_disaggregated(reqs, [PrefillSetup(m, token_budget=l)], [DecodeSetup(m, 10_000)], FAST_LINK)
    mean_wait = sum(r.ttft for r in res.results) / len(res.results) - d
    assert mean_wait == pytest.approx(rho * d / (2 * (1 - rho)), rel=0.05)


def test_batching_raises_prefill_capacity_and_budget_caps_it():
    m = model()
    reqs = [Request(0.0, 100, 1) for _ in range(8)]
    big = simulate_disaggregated(reqs, [PrefillSetup(m, token_budget=800)], [DecodeSetup(m, 1000)], FAST_LINK)
    small = simulate_disaggregated(reqs, [PrefillSetup(m, token_budget=200)], [DecodeSetup(m, 1000)], FAST_LINK)
    assert max(r.ttft for r in big.results) == pytest.approx(m.prefill(800, 8 * 100 ** 2))
    assert max(r.ttft for r in small.results) == pytest.approx(4 * m.prefill(200, 2 * 100 ** 2))


def test_decode_admits_only_what_the_kv_capacity_holds():
    m = model()
    reqs = [Request(0.0, 100, 11) for _ in range(3)]  # each reserves 111 tokens: one at a time in 150
    res = simulate_decode_only(reqs, [DecodeSetup(m, kv_tokens=150)])
    one = decode_sum(m, 100, 11)
    assert [r.e2e for r in res.results] == pytest.approx([one, 2 * one, 3 * one])
    together = simulate_decode_only(reqs, [DecodeSetup(m, kv_tokens=400)])
    assert max(r.e2e for r in together.results) < 1.2 * one  # all three fit: batched, not serial


@pytest.mark.parametrize("seed", range(20))
def test_closed_form_step_runs_equal_step_by_step_sums(seed):
    rng = random.Random(seed)
    lines = ((rng.random(), rng.random() * 1e-3), (rng.random(), rng.random() * 1e-3))
    c0, b = rng.randint(0, 5000), rng.randint(1, 50)
    run = StepRun(lines, c0, b)
    for k in (0, 1, 2, 7, 100):
        ref = sum(max(a1 + b1 * (c0 + j * b), a2 + b2 * (c0 + j * b)) for (a1, b1), (a2, b2) in [lines]
                  for j in range(k))
        assert run.run_time(k) == pytest.approx(ref, rel=1e-9, abs=1e-12)
    limit = run.run_time(37) + 1e-9
    assert run.steps_before(limit, 100) == 37


def test_same_seed_same_results_and_attainment():
    m = model()
    pairs = [(200, 30), (900, 5), (50, 120)]
    runs = [simulate_disaggregated(poisson_requests(pairs, 20.0, 500, seed=3), [PrefillSetup(m)],
                                   [DecodeSetup(m, 20_000)], FAST_LINK) for _ in range(2)]
    assert runs[0].results == runs[1].results
    slo = SLO(0.2, 0.02)
    assert 0 < runs[0].attainment(slo) <= 1
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5  # linear, numpy's default (nearest rank gave 2.0)
