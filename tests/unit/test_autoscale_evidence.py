"""The autoscaler's evidence (cluster/serving/autoscale_evidence.py): a correction factor per load band that
does not carry a factor learnt at low load to a load never measured; what a replica carried within the SLO,
scaled to a heavier length mix, never to a lighter one, forgotten after its horizon and when refuted."""
from __future__ import annotations

import pytest

from cluster.serving.autoscale_evidence import Demonstrated, LoadBands, near_targets
from cluster.serving.autoscale_policy import Finished


def test_a_factor_learnt_at_low_load_promises_nothing_above_it():
    b = LoadBands()
    assert b.factor_at(0.4) == 1.0  # nothing learnt: the model as it is
    for _ in range(20):
        b.learn(0.4, 0.25, 0.5)
    assert b.factor_at(0.4) == pytest.approx(0.25, rel=0.06)
    assert b.factor_at(0.1) == pytest.approx(0.25, rel=0.06)  # below: the lowest band's
    assert b.factor_at(2.4) == 1.0  # above every learnt band: never below 1
    assert b.factor_at(2.4, floor_above=0.0) < 1.0
    for _ in range(20):
        b.learn(1.6, 0.6, 0.5)  # under load the machine's lead shrinks
    mid = b.factor_at(0.8)
    assert 0.25 < mid < 0.6 and b.factor_at(0.4) < mid < b.factor_at(1.6)
    assert b.factor_at(1.6) == pytest.approx(0.6, rel=0.05)
    b.learn(1.6, 100.0, 1.0)
    assert b.factor_at(1.6) <= 4.0  # bounded


def test_what_a_replica_carried_scales_to_a_heavier_mix_only_and_is_forgotten():
    d = Demonstrated(horizon_s=100.0)
    assert d.per_replica([(100, 20)], 0.0) == 0.0
    d.record(10.0, 1.0, [(100, 20)])
    d.record(20.0, 0.6, [(100, 20)])
    assert d.per_replica([(100, 20)], 30.0) == 1.0
    assert d.per_replica([(100, 40)], 30.0) == pytest.approx(0.5)  # twice the output: half the rate
    assert d.per_replica([(300, 20)], 30.0) == pytest.approx(1 / 3)
    assert d.per_replica([(50, 10)], 30.0) == 1.0  # a lighter mix: no more than was carried
    d.refute(0.8)  # the pool missed at 0.8: the 1.0 record no longer holds
    assert d.per_replica([(100, 20)], 30.0) == 0.6
    assert d.per_replica([(100, 20)], 125.0) == 0.0  # past the horizon


def test_near_targets_reads_the_attainment_quantile():
    fs = [Finished(0.0, 10, 5, 1.0, 0.05)] * 9 + [Finished(0.0, 10, 5, 2.5, 0.05)]
    targets = {"ttft": 2.0, "tpot": 0.15}
    assert not near_targets(fs, ("ttft", "tpot"), targets, 0.9, 0.8)  # p90 is 1.0 s
    fs = [Finished(0.0, 10, 5, 1.7, 0.05)] * 10
    assert near_targets(fs, ("ttft",), targets, 0.9, 0.8) and not near_targets(fs, ("tpot",), targets, 0.9, 0.8)
    assert not near_targets([Finished(0.0, 10, 1, 0.1, None)], ("tpot",), targets, 0.9, 0.8)
