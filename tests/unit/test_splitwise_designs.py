"""bench/repro/splitwise/designs.py: per-machine goodput of a pool of n (interpolated in log2 n between measured pool
sizes, held beyond them) and the design search over machine counts within a budget (issue 26)."""
from __future__ import annotations

import pytest

from bench.repro.splitwise.designs import PoolGoodput, best_within, fewest, least_for, machine_numbers

KEY = ("H100", "colocated")


def pools() -> PoolGoodput:
    g = {("A100", "prefill"): 1.0, ("A100", "decode"): 4.0, KEY: 1.0}
    return PoolGoodput({1: g, 16: {k: 2 * v for k, v in g.items()}})


def test_pool_goodput_interpolates_in_log2_and_holds_beyond_the_measured_sizes():
    g = pools()
    assert g(KEY, 1) == 1.0 and g(KEY, 16) == 2.0 and g(KEY, 64) == 2.0
    assert g(KEY, 4) == pytest.approx(1.5)  # log2 4 is half way from log2 1 to log2 16
    assert g.total(KEY, 4) == pytest.approx(6.0) and g.total(KEY, 0) == 0.0


def test_best_split_balances_the_pools_within_the_budget():
    g = pools()
    limit = 10 * machine_numbers("A100")[0]  # ten A100 machines' cost
    thr, a, b = best_within("Splitwise-AA", g, limit, 0)
    assert a + b <= 10 and b >= 1
    assert thr == pytest.approx(min(g.total(("A100", "prefill"), a), g.total(("A100", "decode"), b)))
    assert all(min(g.total(("A100", "prefill"), x), g.total(("A100", "decode"), 10 - x)) <= thr + 1e-9
               for x in range(1, 10))


def test_cheapest_split_for_a_rate_and_an_unreachable_rate():
    g = pools()
    cost, a, b = least_for("Splitwise-AA", g, 5.0, 0)
    assert g.total(("A100", "prefill"), a) >= 5.0 > g.total(("A100", "prefill"), a - 1)
    assert cost == pytest.approx((a + b) * machine_numbers("A100")[0])
    zero = PoolGoodput({1: {KEY: 0.0}})
    with pytest.raises(ValueError, match="cannot reach"):
        fewest(zero, KEY, 1.0)


def test_better_split_climbs_to_the_neighbouring_split_that_serves_most_and_stays_in_budget(monkeypatch):
    """A made-up cluster whose highest rate peaks at 50 prompt machines of 70 (A100s: iso-power budget of
    70 machines); from the sized 40P+30T the search steps 5 at a time to 50P+20T and stops there."""
    from types import SimpleNamespace

    from bench.repro.splitwise import verify as v

    def best(a):
        return 100.0 - abs(a - 50)

    probes = []

    def run(model, pairs, design, a, b, rate, seed=0):
        probes.append((a, b))
        assert a + b <= 70  # within the budget
        return SimpleNamespace(attainment=lambda slo: 1.0 if rate <= best(a) else 0.0)

    monkeypatch.setattr(v, "artifact_run", run)
    monkeypatch.setattr(v, "verify_artifact", lambda model, pairs, slo, design, a, b, rate, seed=0: best(a))
    slo = SimpleNamespace(attainment=1.0)
    a100_w = machine_numbers("A100")[1]
    assert v.better_split(None, [], slo, "Splitwise-AA", 40, 30, best(40), 70 * a100_w, 1) == (100.0, 50, 20)
    assert set(probes) == {(45, 25), (50, 20), (55, 15)}  # up while it gains, one step past; back: no gain
    assert v.better_split(None, [], slo, "Baseline-A100", 70, 0, 60.0, 70 * a100_w, 1) == (60.0, 70, 0)
