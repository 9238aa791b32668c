"""The autoscaler's capacity model over the planner (cluster/serving/autoscale_capacity.py) and the elastic
simulator the GPU-scale bench runs it in (cluster/planner/sim/elastic.py): more rate or a slower model
(correction) never needs fewer replicas; a pool that does not change size simulates as `simulate_colocated`
does; a pool that grows and shrinks finishes every request and pays for what it ran."""
from __future__ import annotations

from cluster.planner.inputs.workload import poisson_requests
from cluster.planner.latency.base import Coeffs, FittedLatency, Parallel
from cluster.planner.sim.coloc import ColocSetup, simulate_colocated
from cluster.planner.sim.elastic import simulate_elastic
from cluster.planner.sim.metrics import SLO
from cluster.serving.autoscale_capacity import PlannerCapacity, ScaledLatency, capacity_for_spec
from cluster.serving.autoscale_policy import Load
from cluster.spec import parse_spec

# a made-up engine: prefill 20 ms + 0.1 ms/token, decode step 10 ms + 1 us per context token
MODEL = FittedLatency(Parallel(), Coeffs((0.02, 1e-4, 0.0), (0.01, 1e-6, 0.0)))
SETUP = ColocSetup(MODEL, kv_tokens=20000, token_budget=512, max_seqs=32)
PAIRS = ((200, 20), (400, 40), (100, 10))


def test_needed_grows_with_the_rate_and_the_correction_and_stays_in_bounds():
    cap = PlannerCapacity({"colocated": SETUP}, SLO(0.5, 0.05, 0.9))
    needs = [cap.needed("colocated", Load(r, r, r, PAIRS), 1.0, (1, 16)) for r in (1, 5, 20, 40, 80)]
    assert needs == sorted(needs) and needs[0] == 1 and needs[-1] > 2, needs
    slower = cap.needed("colocated", Load(40, 40, 40, PAIRS), 2.0, (1, 16))
    assert slower > needs[3]
    assert cap.needed("colocated", Load(1e4, 1, 1, PAIRS), 1.0, (1, 3)) == 4  # beyond max: max + 1
    assert cap.needed("colocated", Load(0.0, 0, 0, PAIRS), 1.0, (2, 3)) == 2
    assert abs(ScaledLatency(MODEL, 2.0).mixed(100, 1e4, 3, 300) - 2 * MODEL.mixed(100, 1e4, 3, 300)) < 1e-12
    p = cap.predict("colocated", Load(5, 5, 5, PAIRS), 2)
    assert set(p) == {"ttft", "tpot"} and all(v > 0 for v in p.values())


def test_the_spec_gives_the_planner_model_of_its_pools():
    spec = parse_spec({"model": "smollm2-135m", "mode": "colocated", "pools": {"colocated": {"replicas": 1}},
                       "slo": {"ttft_ms": 3000, "tpot_ms": 300}})
    cap = capacity_for_spec(spec)
    s = cap.setups["colocated"]
    assert s.kv_tokens == 1024 * 16 and s.token_budget == 512 and s.max_seqs == 32
    assert cap.needed("colocated", Load(0.2, 0.2, 0.2, ((256, 32),)), 1.0, (1, 4)) == 1


def test_an_elastic_pool_at_a_fixed_size_is_the_colocated_simulation():
    reqs = poisson_requests(list(PAIRS), 30, 1500, seed=1)
    fixed = simulate_elastic(reqs, SETUP, lambda now, v: 2, 1.0, 5.0, 2)
    alone = simulate_colocated(reqs, [SETUP, SETUP])
    assert fixed.result.results == alone.results and fixed.events == []
    assert abs(fixed.replica_seconds - 2 * alone.duration) < 1e-6


def test_an_elastic_pool_grows_late_drains_and_finishes_everything():
    reqs = poisson_requests(list(PAIRS), 20, 1000, seed=2)
    plan = lambda now, v: 3 if 10 <= now < 30 else 1  # noqa: E731
    res = simulate_elastic(reqs, SETUP, plan, 1.0, 5.0, 1)
    assert [(round(t), a, b) for t, a, b in res.events] == [(10, 1, 3), (30, 3, 1)]
    assert len(res.result.results) == len(reqs) and all(r.e2e > 0 for r in res.result.results)
    serving = {round(t): s for t, _, s in res.timeline}
    assert serving[12] == 1 and serving[16] == 3  # a new replica serves 5 s after the decision
    end = res.result.duration
    assert end + 2 * 20 <= res.replica_seconds <= end + 2 * (20 + 3)  # paid from the decision to the release
