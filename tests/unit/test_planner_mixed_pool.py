"""bench/repro/splitwise/mixed_pool.py: Splitwise's prompt, token and mixed machine pools (issue 26).

A made-up table keeps the arithmetic checkable: a prompt iteration costs 1 ms per batch token (x1.1 with
decodes aboard), a token iteration 10 ms whatever its batch. Every test ends with the scheduler's
bookkeeping back at zero on every machine (nothing placed, no KV held)."""
from __future__ import annotations

import pytest

from bench.repro.splitwise.baseline import ArtifactSetup
from bench.repro.splitwise.mixed_pool import PoolLimits, _Pools, simulate_mixed_pool
from bench.repro.splitwise.step_table import StepTable, TableLatency
from cluster.planner.inputs.workload import Request
from cluster.planner.latency.base import Coeffs, FittedLatency, Parallel
from cluster.planner.sim.coloc import simulate_colocated
from cluster.planner.sim.disagg import Link

TABLE = TableLatency(StepTable((1.0, 10_000.0), (0.001, 10.0), (0.010, 0.010)))
LINK = Link(kv_bytes_per_token=1000.0, bandwidth=1e6, layers=1)  # 1 ms per prompt token


def machines(n: int, kv: int = 100_000) -> list[ArtifactSetup]:
    return [ArtifactSetup(TABLE, kv, 2048, 256, True)] * n


def run(requests, prompt, token, limits=PoolLimits()):
    sim = _Pools(requests, prompt, token, LINK, limits)
    roles = []
    arrive = sim.arrive

    def watched(i):
        arrive(i)
        roles.append(tuple(m.role for m in sim.machines))
    for i, r in enumerate(requests):
        sim.ev.at(r.arrival, watched, i)
    sim.ev.run()
    for m in sim.machines:  # leak check: every placement undone, every reservation freed
        assert (m.sched_pending, m.sched_kv, m.used, m.seqs, m.batch) == (0, 0, 0, 0, 0), m.home
        assert m.idle() and m.role == m.home
    assert not sim.token_of
    return sim, roles


def test_a_lone_request_prompts_on_a_prompt_machine_ships_its_kv_and_decodes_on_a_token_machine():
    sim, roles = run([Request(0.0, 100, 5)], machines(1), machines(1))
    first, done = sim.st.first[0], sim.st.done[0]
    assert first == pytest.approx(0.100)  # 100 prompt tokens at 1 ms
    assert done == pytest.approx(0.100 + 0.100 + 4 * 0.010)  # + the KV's 100 ms + 4 token iterations
    assert roles == [("prompt", "token")]
    assert simulate_mixed_pool([Request(0.0, 100, 5)], machines(1), machines(1), LINK).results[0].e2e == \
        pytest.approx(done)


def test_a_one_token_request_ends_on_its_prompt_machine():
    sim, _ = run([Request(0.0, 50, 1)], machines(1), machines(1))
    assert sim.st.first[0] == sim.st.done[0] == pytest.approx(0.050)


def test_long_prompt_queues_borrow_a_token_machine_which_mixes_prompts_into_its_decodes():
    burst = [Request(0.001 * k, 2000, 3) for k in range(12)]  # 24k prompt tokens at once: past 8192 queued
    sim, roles = run(burst, machines(1), machines(1))
    assert any(r[1] == "mixed" for r in roles), roles
    never = [Request(r.arrival, r.input_len, r.output_len) for r in burst]
    alone, _ = run(never, machines(1), machines(1), PoolLimits(prompt_queue_tokens=10**9))
    assert max(sim.st.first) < max(alone.st.first)  # the borrowed machine cut the last prompt's wait


def test_full_token_machines_borrow_a_prompt_machine_for_tokens():
    long_outputs = [Request(0.01 * k, 100, 200) for k in range(6)]  # 300 KV tokens each, 700 fit
    sim, roles = run(long_outputs, machines(1), machines(1, kv=700))
    assert any(r[0] == "mixed" for r in roles), roles
    assert all(d > 0 for d in sim.st.done)


def test_with_nothing_to_borrow_a_request_runs_whole_on_the_least_loaded_machine():
    reqs = [Request(0.0, 100, 200), Request(0.0, 100, 200), Request(0.0, 100, 200)]
    sim, roles = run(reqs, machines(1, kv=350), machines(1, kv=350))
    assert roles[-1] == ("mixed", "token")  # the prompt machine took the second's tokens; the third runs whole
    assert all(d > 0 for d in sim.st.done)


def test_the_artifacts_baseline_router_counts_prompt_tokens_to_compute_not_outputs_to_come():
    """token_jsq (`route="prompts"`) sends a short prompt to the machine decoding a long answer rather than
    behind another machine's long prompt; pdserve's router (outstanding tokens) does the opposite here."""
    reqs = [Request(0.0, 10, 1000), Request(0.0001, 500, 2), Request(0.001, 10, 2)]
    ttft = {}
    for route in ("prompts", "outstanding"):
        setups = [ArtifactSetup(TABLE, 100_000, 2048, 256, True, route)] * 2
        ttft[route] = simulate_colocated(reqs, setups).results[2].ttft
    assert ttft["prompts"] < 0.05 < 0.4 < ttft["outstanding"]  # beside a decode vs behind a 500 ms prompt


def test_whole_prompts_run_unchunked_and_batch_fcfs_within_the_budget():
    """ArtifactSetup(whole_prompts=True), Splitwise's baselines (baseline.py): a prompt over the budget runs
    whole and alone; two that fit together share one step."""
    m = FittedLatency(Parallel(), Coeffs(prefill=(0.010, 2e-5, 1e-9), decode=(0.008, 1e-7, 2e-4)))
    long = simulate_colocated([Request(0.0, 1000, 2)], [ArtifactSetup(m, 10_000, 256, whole_prompts=True)]).results[0]
    assert long.ttft == pytest.approx(m.prefill(1000, 1000 * 1000))
    # two short prompts queued behind a long one share the next step
    r = simulate_colocated([Request(0.0, 1000, 1), Request(0.001, 100, 2), Request(0.002, 120, 2)],
                           [ArtifactSetup(m, 10_000, 256, whole_prompts=True)]).results
    first = m.mixed(1000, 1000 * 1000, 0, 0)
    both = m.mixed(220, 100 * 100 + 120 * 120, 0, 0)
    assert r[1].ttft == pytest.approx(first + both - 0.001) and r[2].ttft == pytest.approx(first + both - 0.002)
