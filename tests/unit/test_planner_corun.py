"""Co-run interference in the planner (`bus.py`): instances on one node's memory bus slow each other's
steps by the profile's measured factors. Factor 1 (or no sharing) leaves every prediction unchanged;
measured factors > 1 slow a step exactly by its factor while a neighbour is mid-step, and lower the
goodput of two colocated replicas on one node; the profile loader rejects unknown pairs and clocks."""
from __future__ import annotations

import json

import pytest

from cluster.planner.errors import BadConfigError
from cluster.planner.inputs.workload import Request, poisson_requests
from cluster.planner.latency.base import Coeffs, FittedLatency, Parallel
from cluster.planner.latency.interference import Corun
from cluster.planner.latency.profiles import corun_of, load_profile
from cluster.planner.search.goodput import bisect_rate
from cluster.planner.sim.bus import Bus, Sharing, pack_nodes
from cluster.planner.sim.coloc import ColocSetup, simulate_colocated
from cluster.planner.sim.disagg import DecodeSetup, Link, PrefillSetup, simulate_disaggregated
from cluster.planner.sim.metrics import SLO

COEFFS = Coeffs(prefill=(0.010, 2e-5, 1e-9), decode=(0.008, 1e-7, 2e-4))
LINK = Link(kv_bytes_per_token=1000.0, bandwidth=1e12, layers=10)
ONES = Corun.from_dict({f"{a}_beside_{b}": 1.0 for a in ("prefill", "decode") for b in ("prefill", "decode")})
MEASURED = Corun.from_dict({"decode_beside_decode": 1.5, "decode_beside_prefill": 1.3,
                            "prefill_beside_decode": 1.2, "prefill_beside_prefill": 1.4})


def model() -> FittedLatency:
    return FittedLatency(Parallel(), COEFFS)


def coloc_requests(n: int = 300, rate: float = 20.0):
    pairs = [(200, 40), (600, 10), (100, 120), (900, 5)]
    return poisson_requests(pairs, rate, n, seed=3)


def test_bus_adds_the_excess_of_busy_neighbours_only():
    bus = Bus(MEASURED)
    assert bus.factor(0, "decode") == 1.0  # alone on the node
    bus.set(0, "decode")
    assert bus.factor(0, "decode") == 1.0  # its own step does not count
    bus.set(1, "prefill")
    bus.set(2, "decode")
    assert bus.factor(0, "decode") == pytest.approx(1 + 0.3 + 0.5)
    bus.set(1, None)
    assert bus.factor(0, "prefill") == pytest.approx(1.2)
    assert Corun.none().factor("decode", "decode") == 1.0 and ONES.is_none and not MEASURED.is_none


def test_factor_one_leaves_both_simulators_unchanged():
    reqs, setup = coloc_requests(), ColocSetup(model(), 20_000, 512, 32)
    old = simulate_colocated(reqs, [setup] * 2)
    assert simulate_colocated(reqs, [setup] * 2, Sharing(ONES, (0, 0))) == old
    assert simulate_colocated(reqs, [setup] * 2, Sharing(Corun.none(), (0, 0))) == old
    pre, dec = [PrefillSetup(model(), 512, 8)], [DecodeSetup(model(), 20_000, 32)]
    old = simulate_disaggregated(reqs, pre, dec, LINK)
    assert simulate_disaggregated(reqs, pre, dec, LINK, Sharing(ONES, (0, 0))) == old


def test_prefill_beside_a_decoding_neighbour_takes_its_factor_exactly():
    m = model()
    first = Request(0.0, 100, 2000)  # decodes for ~20 s on the decode instance
    second = Request(5.0, 300, 2)  # its prefill starts while that decode runs
    pre, dec = [PrefillSetup(m)], [DecodeSetup(m, 100_000)]
    alone = simulate_disaggregated([first, second], pre, dec, LINK).results
    shared = simulate_disaggregated([first, second], pre, dec, LINK, Sharing(MEASURED, (0, 0))).results
    assert alone[0].ttft == shared[0].ttft == pytest.approx(m.prefill(100, 100 ** 2))  # decode was idle
    assert alone[1].ttft == pytest.approx(m.prefill(300, 300 ** 2))
    assert shared[1].ttft == pytest.approx(1.2 * m.prefill(300, 300 ** 2))
    # on separate nodes nothing changes
    assert simulate_disaggregated([first, second], pre, dec, LINK, Sharing(MEASURED, (0, 1))).results == alone


def test_colocated_replicas_on_one_bus_decode_slower_and_lose_goodput():
    reqs, setup = coloc_requests(), ColocSetup(model(), 20_000, 512, 32)
    alone = simulate_colocated(reqs, [setup] * 2)
    shared = simulate_colocated(reqs, [setup] * 2, Sharing(MEASURED, (0, 0)))
    split = simulate_colocated(reqs, [setup] * 2, Sharing(MEASURED, (0, 1)))
    assert split == alone
    mean_tpot = lambda res: sum(r.tpot for r in res.results) / len(res.results)  # noqa: E731
    assert mean_tpot(shared) > 1.1 * mean_tpot(alone)
    # goodput of the two replicas: one bus with the measured factors vs factor 1 (what the planner predicted)
    pairs, slo = [(300, 20), (800, 8)], SLO(ttft_s=0.5, tpot_s=0.05, attainment=0.9)

    def goodput(corun: Corun) -> float:
        run = lambda rate: simulate_colocated(poisson_requests(pairs, rate, 600, seed=1), [setup] * 2,  # noqa: E731
                                              Sharing(corun, (0, 0))).attainment(slo)
        return bisect_rate(run, slo.attainment, 10.0, rel_tol=0.02)[0]

    old, ones, measured = goodput(Corun.none()), goodput(ONES), goodput(MEASURED)
    assert ones == old
    assert 0 < measured < 0.9 * old


def test_pack_nodes_places_instances_first_fit_decreasing():
    assert pack_nodes([1, 1, 1], 2, 2) == (0, 0, 1)
    assert pack_nodes([1, 2, 1], 2, 2) == (1, 0, 1)
    assert pack_nodes([2, 2, 2], 2, 2) is None


def test_profile_corun_entry_loads_and_rejects_unknown_pairs(tmp_path):
    base = {"name": "t", "model": "smollm2-135m", "hardware": "cpu-local",
            "tp": {"1": {"prefill": [0.01, 1e-3, 0.0], "decode": [0.05, 1e-5, 1e-3]}}}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(base))
    assert corun_of(load_profile(str(path))).is_none  # no entry: factor 1 (GPUs, old profiles)
    assert corun_of(None).is_none
    path.write_text(json.dumps({**base, "corun": {"slowdown": {"decode_beside_decode": 1.25}}}))
    assert corun_of(load_profile(str(path))).factor("decode", "decode") == 1.25
    path.write_text(json.dumps({**base, "corun": {"slowdown": {"decode_beside_gpu": 1.25}}}))
    with pytest.raises(BadConfigError, match="decode_beside_gpu"):
        load_profile(str(path))


def test_profile_corun_clock_picks_cpu_wall_or_no_factors(tmp_path):
    entry = {"slowdown": {"decode_beside_decode": 1.1}, "wall_slowdown": {"decode_beside_decode": 1.9}}
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"name": "t", "model": "smollm2-135m", "hardware": "cpu-local",
                                "tp": {"1": {"prefill": [0.01, 1e-3, 0.0], "decode": [0.05, 1e-5, 1e-3]}},
                                "corun": entry}))
    assert load_profile(str(path)).corun.factor("decode", "decode") == 1.1
    assert load_profile(str(path), "wall").corun.factor("decode", "decode") == 1.9
    assert load_profile(str(path), "off").corun.is_none
    with pytest.raises(BadConfigError, match="co-run clock"):
        load_profile(str(path), "gpu")


@pytest.mark.parametrize("clock", ["off", "cpu"])
def test_plan_report_compares_modes_on_equal_gpus_with_the_slowdown(tmp_path, clock, capsys):
    from cluster.cli import main

    profile = {"name": "synthetic-cpu", "model": "smollm2-135m", "dtype": "bfloat16", "hardware": "cpu-local",
               "tp": {"1": {"prefill": [0.02, 1.1e-3, 1e-8], "decode": [0.03, 2e-7, 2e-3]}},
               "corun": {"slowdown": {f"{a}_beside_{b}": 2.0 for a in ("prefill", "decode")
                                      for b in ("prefill", "decode")}}}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile))
    args = ["plan", "--model", "smollm2-135m", "--hardware", "cpu-local", "--nodes", "1", "--gpus-per-node", "2",
            "--input-len", "uniform:100:300", "--output-len", "20", "--rate", "0.5", "--ttft-ms", "1500",
            "--tpot-ms", "150", "--profile", str(path), "--corun", clock, "--out", str(tmp_path / "c.yaml"),
            "--report", str(tmp_path / "r")]
    assert main(args) == 0
    assert "on equal GPUs (2): colocated x2" in capsys.readouterr().out
    summary = json.loads((tmp_path / "r" / "plan.json").read_text())
    one, two = summary["whole_plan_goodput"]["colocated"], summary["equal_gpus"]["colocated"]
    assert summary["chosen"]["gpus"] == 1 and summary["equal_gpus"]["replicas"] == 2
    if clock == "off":  # two replicas behind one router serve at least twice one
        assert two >= 1.9 * one
    else:  # every step of one replica beside a busy one takes twice as long
        assert two < 1.5 * one


def test_corun_summary_pairs_each_window_with_its_rounds_alone_window():
    from cluster.planner.calibrate.corun import summarize

    # (cpu s, wall s) window medians per round: the machine drifts 2x between rounds, the ratio does not
    windows = {("decode", "none"): [(0.05, 0.05), (0.10, 0.10), (0.05, 0.06)],
               ("decode", "decode"): [(0.06, 0.10), (0.12, 0.20), (0.07, 0.12)],
               ("decode", "prefill"): [(0.05, 0.05), (0.10, 0.10), (0.05, 0.06)]}
    share = {("decode", "decode"): [0.9, 1.0, 0.95], ("decode", "prefill"): [1.0, 1.0, 1.0]}
    out = summarize(windows, share, 3)
    assert out["slowdown"]["decode_beside_decode"] == pytest.approx(1.2)
    assert out["spread"]["decode_beside_decode"] == pytest.approx([1.2, 1.4])
    assert out["wall_slowdown"]["decode_beside_decode"] == pytest.approx(2.0)
    assert out["slowdown"]["decode_beside_prefill"] == 1.0
    assert out["neighbour_cpu_share"]["decode_beside_decode"] == 0.95
