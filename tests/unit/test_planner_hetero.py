"""Heterogeneous, cost- and power-aware planning (issue 26, planner half): hardware cost/power fields and
their overrides, objective selection on a hand-made two-type case (the pairing wins on cost, then loses
when its decode type gets dear), budgets, the KV transfer between types, the Pareto front, the spec's
accelerator_type and the reports' short plot labels. Synthetic hardware on the roofline: no profiles."""
from __future__ import annotations

from dataclasses import replace

import pytest

from cluster.planner.emit.design_report import front, plot_designs, why_winner
from cluster.planner.emit.spec_writer import plan_spec, write_spec
from cluster.planner.errors import PlannerError, UnknownHardwareError
from cluster.planner.inputs.hardware import Hardware, load_hardware
from cluster.planner.inputs.models import ModelSpec
from cluster.planner.inputs.workload import Request
from cluster.planner.latency.base import ZeroLatency
from cluster.planner.latency.base import Parallel
from cluster.planner.search.cost import parse_hardware_list, parse_overrides, plan_power, require, with_overrides
from cluster.planner.search.designs import Budget, Design, measure_types, plan_designs
from cluster.planner.search.kv_link import cross_type_bandwidth, reshard_cost
from cluster.planner.search.pareto import pareto_front
from cluster.planner.search.plans import PhaseChoice, Plan
from cluster.planner.search.request import PlanRequest
from cluster.planner.sim.disagg import DecodeSetup, Link, PrefillSetup, simulate_disaggregated
from cluster.planner.sim.metrics import SLO

# 100M parameters: a 1000-token prompt is compute-bound (0.33 s on "fast", 1.3 s on "mem"); a decode step
# reads the weights (same HBM on both: as fast on either)
MID = ModelSpec("mid", layers=8, hidden=1024, heads=8, kv_heads=8, head_dim=128, ffn=4096, vocab=1000,
                max_positions=4096, params=1e8)


def hw(name: str, peak: float, price: float | None, watts=(300.0, 200.0), inter_node=1e9) -> Hardware:
    return Hardware(name, peak, 1e11, 4e9, 1e11, 1e10, inter_node, None, name.upper(), price,
                    watts[0], watts[0], watts[1])


FAST, MEM = hw("fast", 1e12, 2.0), hw("mem", 2.5e11, 1.0)


def request(rate: float = 1.0) -> PlanRequest:
    return PlanRequest(MID, FAST, 3, 1, ((1000, 50),), rate, SLO(2.0, 0.03, 0.9), max_len=4096,
                       prefill_budgets=(2048,), coloc_budgets=(512,), types=(FAST, MEM))


@pytest.fixture(scope="module")
def measured():
    """Per-instance goodputs on both types, measured once (prices do not change them)."""
    return measure_types(request(), [FAST, MEM])


def test_hardware_entries_carry_price_power_and_ray_type():
    a100 = load_hardware("a100")
    assert (a100.price_per_hour, a100.tdp_w, a100.accelerator_type) == (2.21, 400, "A100")
    assert a100.decode_w < a100.prefill_w <= a100.tdp_w
    cap, h100 = load_hardware("splitwise-h100cap"), load_hardware("dgx-h100")
    assert cap.tdp_w == pytest.approx(0.7 * h100.tdp_w) and cap.price_per_hour == h100.price_per_hour
    assert cap.hbm_bw == h100.hbm_bw and cap.peak_flops < h100.peak_flops  # capped: compute slows, HBM does not
    cpu = load_hardware("cpu")
    assert cpu.accelerator_type is None and cpu.price_per_hour is None


def test_price_and_power_overrides():
    prices = parse_overrides("--price", ["h100=3.5"], "USD")
    powers = parse_overrides("--power", ["a100-80g=350"], "W")
    assert prices == {"h100-80g-sxm": 3.5} and powers == {"a100-80g": 350.0}
    assert with_overrides(load_hardware("h100"), prices, powers).price_per_hour == 3.5
    a100 = with_overrides(load_hardware("a100"), prices, powers)
    assert (a100.tdp_w, a100.prefill_w, a100.decode_w, a100.price_per_hour) == (350, 350, 350, 2.21)
    for bad, message in ((["h100=-1"], "must be >= 0"), (["h100"], "give NAME=USD"), (["h100=cheap"], "not a number")):
        with pytest.raises(PlannerError, match=message):
            parse_overrides("--price", bad, "USD")
    with pytest.raises(UnknownHardwareError, match="--price: unknown hardware 'b300'.*known: a100-80g, cpu-local"):
        parse_overrides("--price", ["b300=9"], "USD")


def test_unknown_hardware_in_a_list_names_the_known_ones():
    assert parse_hardware_list("h100, a100,h100") == ["h100-80g-sxm", "a100-80g"]
    with pytest.raises(UnknownHardwareError, match=r"--hardware: unknown hardware 'a10x'.*known: a100-80g"):
        parse_hardware_list("h100,a10x")


def test_missing_or_negative_numbers_name_the_flag():
    no_price = replace(FAST, price_per_hour=None)
    with pytest.raises(PlannerError, match="--objective cost needs a price for fast.*--price fast=USD"):
        require([no_price, MEM], "cost", None, None)
    with pytest.raises(PlannerError, match="--budget-power needs power for fast.*--power fast=W"):
        require([replace(FAST, prefill_w=None), MEM], None, None, 5000)
    with pytest.raises(PlannerError, match="--budget-cost must be > 0"):
        require([FAST], None, -1, None)
    require([no_price], "gpus", None, None)  # GPU count needs no price


def test_heterogeneous_pairing_wins_on_cost_when_each_phase_sits_on_its_cheaper_type(measured):
    res = plan_designs(request(), [FAST, MEM], "cost", measured=measured)
    best = res.best.plan
    assert [(c.phase, c.hardware) for c, _ in best.pools] == [("prefill", "fast"), ("decode", "mem")]
    assert best.attainment >= 0.9 and not res.best.homogeneous
    homogeneous = [d for d in res.designs if d.homogeneous]
    assert homogeneous and all(res.best.cost < d.cost for d in homogeneous)
    assert "a decode pool" in why_winner(res, request().hw_of)


def test_heterogeneous_pairing_loses_when_its_decode_type_is_dear(measured):
    dear = replace(MEM, price_per_hour=3.0)  # decode on "mem" now costs more than on "fast"
    res = plan_designs(replace(request(), types=(FAST, dear)), [FAST, dear], "cost", measured=measured)
    assert res.best.homogeneous and {c.hardware for c, _ in res.best.plan.pools} == {"fast"}
    assert any(not d.homogeneous for d in res.designs)  # it was considered, and lost
    # by GPU count the cross-type plan ties and loses on per-GPU goodput or wins: never more GPUs
    by_gpus = plan_designs(replace(request(), types=(FAST, dear)), [FAST, dear], "gpus", measured=measured)
    assert by_gpus.best.plan.gpus == min(d.plan.gpus for d in by_gpus.designs)


def test_budget_gives_the_most_goodput_within_it_or_names_the_cheapest_design(measured):
    res = plan_designs(request(), [FAST, MEM], "cost", Budget("cost", 6.0), measured=measured)
    assert all(d.cost <= 6.0 for d in res.designs)
    assert res.best.goodput == max(d.goodput for d in res.designs) > 0
    with pytest.raises(PlannerError, match=r"--budget-cost 0.5: no design fits within it; the cheapest design "
                                           r".* needs \$\d+\.\d\d/h: give --budget-cost"):
        plan_designs(request(), [FAST, MEM], "cost", Budget("cost", 0.5), measured=measured)


def test_kv_transfer_between_types_uses_the_slower_link_and_pays_a_reshard():
    p = PhaseChoice("prefill", Parallel(4, 1), 2048, 10_000, 8, 1.0, hardware="fast")
    d2 = PhaseChoice("decode", Parallel(2, 1), 0, 10_000, 8, 1.0, hardware="mem")
    d4 = replace(d2, parallel=Parallel(4, 1))
    slow = replace(MEM, inter_node_bw=1e8)
    assert cross_type_bandwidth(FAST, slow, p, d2) == 1e8 * 2  # two sending devices at the slower NIC
    assert reshard_cost(MID, "bfloat16", p, d4, MEM) == 0.0  # equal TP: shards map one to one
    per_token = reshard_cost(MID, "bfloat16", p, d2, MEM)
    assert per_token == pytest.approx(2 * MID.kv_bytes_per_token() / 2 / MEM.hbm_bw)
    # in the simulator the re-layout delays decode: free compute, so TPOT is the re-shard alone
    reqs = [Request(0.0, 1000, 11)]
    link = Link(MID.kv_bytes_per_token(), float("inf"), MID.layers, per_token)
    res = simulate_disaggregated(reqs, [PrefillSetup(ZeroLatency())], [DecodeSetup(ZeroLatency(), 1 << 20)], link)
    assert res.results[0].tpot == pytest.approx(1000 * per_token / 10)


def test_pareto_front():
    pts = [(10, 5, 100), (8, 4, 90), (10, 6, 100), (12, 7, 120), (7, 4, 95), (None, 1, 1)]
    assert pareto_front(pts, ("max", "min", "min")) == [0, 1, 3]
    designs = [Design("f", Plan("colocated", "colocated", (), 1), c, w, g, True, f"D{k}")
               for k, (g, c, w) in enumerate(pts[:5])]
    assert front(designs) == {"D0", "D1", "D3"}


def test_plan_power_charges_each_pool_its_phase_draw():
    p = PhaseChoice("prefill", Parallel(2, 1), 2048, 1, 8, 1.0, hardware="fast")
    d = PhaseChoice("decode", Parallel(1, 1), 0, 1, 8, 1.0, hardware="mem")
    plan = Plan("disaggregated", "cross-type", ((p, 3), (d, 2)), 8)
    assert plan_power(plan, request().hw_of) == 3 * 2 * 300 + 2 * 1 * 200


def test_spec_pools_ask_for_their_accelerator_type(tmp_path):
    p = PhaseChoice("prefill", Parallel(1, 1), 2048, 100_000, 8, 1.0, hardware="h100-80g-sxm")
    d = PhaseChoice("decode", Parallel(2, 1), 0, 100_000, 8, 1.0, hardware="a100-80g")
    plan = Plan("disaggregated", "cross-type", ((p, 2), (d, 1)), 4)
    spec = plan_spec(plan, "HuggingFaceTB/SmolLM2-135M-Instruct", "bfloat16", 2, False, 2048, 500, 50,
                     {"prefill": "H100", "decode": "A100"})
    assert spec["pools"]["prefill"]["resources"] == {"num_cpus": 1, "num_gpus": 1, "accelerator_type": "H100"}
    assert spec["pools"]["decode"]["resources"]["accelerator_type"] == "A100"
    cpu = plan_spec(plan, "m", "bfloat16", 1, True, 2048, 500, 50, {"prefill": None, "decode": None})
    assert all("accelerator_type" not in pool["resources"] for pool in cpu["pools"].values())
    write_spec(spec, tmp_path / "c.yaml", ["test"])  # the schema checks the rest; the key is written
    assert "accelerator_type: H100" in (tmp_path / "c.yaml").read_text()


def test_reports_plot_short_labels(tmp_path):
    plan = Plan("colocated", "colocated", (), 8)
    designs = [Design("h100-80g-sxm->a100-80g", plan, 30.0, 4000.0, 12.0, False, "D1"),
               Design("colocated h100-80g-sxm", plan, 38.0, 5600.0, 11.0, True, "D2")]
    drawn = plot_designs(tmp_path / "designs.png", designs, {"D1"}, "title")
    assert sorted(drawn) == ["D1", "D1", "D2", "D2"]  # two panels, labels only: the names sit in the key/table
    assert (tmp_path / "designs.png").stat().st_size > 1000

    from cluster.planner.emit.report import _plot
    long = "disaggregated [independent] 3x prefill tp1pp5/b8192 + 2x decode tp4pp1 = 23 GPUs"
    labels = _plot(tmp_path / "attainment.png", request(), {"P1 (chosen)": [(1.0, 0.95), (2.0, 0.5)]})
    assert labels[0] == "P1 (chosen)" and all(long not in x and len(x) <= 25 for x in labels)
    assert (tmp_path / "attainment.png").stat().st_size > 1000
