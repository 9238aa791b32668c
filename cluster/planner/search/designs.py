"""Heterogeneous planning (Splitwise): `plan_designs(req, hws, objective, budget) -> DesignResult`.

Order of work:
  1. per machine type: its TP x PP configurations and the per-instance goodputs of each kind (the same
     coarse/fine passes as `search`), each `PhaseChoice` tagged with its hardware;
  2. families of designs: every prefill-type x decode-type pairing (disaggregated; same type: `pool_placement`'s
     independent and co-node plans; two types: pools on their own machines, KV over the slower inter-node
     link, re-sharded when TP differs: `kv_link`) and colocated per type;
  3. sizing: for a target rate, replicas = ceil(rate / goodput) per pool; for a budget (`--budget-cost`
     USD/h or `--budget-power` W), the replica split with the most goodput whose spend fits;
  4. whole-plan checks: rate mode simulates each family's best candidates by the objective at the rate,
     adding replicas while one misses and shrinking the passing one (`pool_placement`); budget mode measures
     the whole-plan goodput of each family's best split (`probe.PlanProbe`);
  5. each family's best is a `Design`; the winner is the best by the objective (rate mode) or the most
     goodput within the budget. No design within a budget: a typed error naming the cheapest design.
Who calls: `commands/designs_cmd` (`pdserve plan` with several types, an objective or a budget),
bench/repro/splitwise/repro.py.
Pure Python.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

from cluster.planner.errors import InfeasibleSLOError, NoFeasibleConfigError, PlannerError
from cluster.planner.inputs.hardware import Hardware
from cluster.planner.search import pool_placement
from cluster.planner.search.configs import instance_configs
from cluster.planner.search.cost import objective_key, plan_cost, plan_power
from cluster.planner.search.kv_link import cross_type_bandwidth
from cluster.planner.search.plan_search import phase_choices
from cluster.planner.search.plans import PhaseChoice, Plan
from cluster.planner.search.probe import PlanProbe
from cluster.planner.search.request import PlanRequest


@dataclass(frozen=True)
class Budget:
    kind: str  # cost | power
    limit: float  # USD per hour | watts

    @property
    def flag(self) -> str:
        return f"--budget-{self.kind}"

    def describe(self, value: float) -> str:
        return f"${value:,.2f}/h" if self.kind == "cost" else f"{value / 1000:,.2f} kW"


@dataclass(frozen=True)
class Design:
    family: str  # "a100->h100" (prefill type -> decode type) or "colocated a100"
    plan: Plan
    cost: float | None  # USD per hour
    power: float | None  # watts
    goodput: float  # req/s: whole-plan simulated (budget mode) or from per-instance goodputs
    homogeneous: bool  # one machine type (the baselines the report sets it beside)
    label: str = ""  # D1, D2, ... (the report's short names)

    @property
    def name(self) -> str:
        return self.plan.describe()

    @property
    def per_dollar(self) -> float | None:
        return self.goodput / self.cost if self.cost else None


@dataclass(frozen=True)
class DesignResult:
    best: Design
    designs: tuple[Design, ...]  # one per family, best first
    phases: tuple[PhaseChoice, ...]
    objective: str
    budget: Budget | None
    seconds: float
    rejected: tuple[str, ...] = ()


def _family(plan: Plan) -> str:
    if plan.mode == "colocated":
        return f"colocated {plan.pools[0][0].hardware}"
    (p, _), (d, _) = plan.pools
    return f"{p.hardware}->{d.hardware}"


def measure_types(req: PlanRequest, hws: list[Hardware]) -> tuple[dict[str, dict[str, list[PhaseChoice]]], list[str]]:
    """Per-instance goodputs of every kind on every type (step 1)."""
    out, rejected = {}, []
    for hw in hws:
        rh = replace(req, hw=hw)
        configs, rej = instance_configs(req.model, hw, req.dtype, req.gpus_per_node, req.total_gpus, req.model_len)
        rejected += [f"{hw.name}: {r}" for r in rej]
        if not configs:
            continue
        phases, _ = phase_choices(rh, configs)
        out[hw.name] = {k: [replace(c, hardware=hw.name) for c in v] for k, v in phases.items()}
    if not out:
        names = ", ".join(h.name for h in hws)
        raise NoFeasibleConfigError(f"{req.model.name} fits no TP x PP on {req.nodes} x {req.gpus_per_node} of any "
                                    f"of {names}: " + "; ".join(rejected[:4]) + "; give more --nodes or bigger devices")
    return out, rejected


def _cross(req: PlanRequest, p: PhaseChoice, d: PhaseChoice, n_p: int, n_d: int) -> Plan | None:
    link = cross_type_bandwidth(req.hw_of(p.hardware), req.hw_of(d.hardware), p, d)
    shell = Plan("disaggregated", "cross-type", ((p, 1), (d, 1)), p.parallel.gpus + d.parallel.gpus, link)
    return pool_placement.resized_plan(req, shell, [(p, n_p), (d, n_d)])


def rate_candidates(req: PlanRequest, phases: dict) -> list[Plan]:
    """Plans sized for the target rate by per-instance goodputs (step 3, rate mode)."""
    plans: list[Plan] = []
    for pt, pk in phases.items():
        for dt, dk in phases.items():
            for p in pk["prefill"]:
                for d in dk["decode"]:
                    if pt == dt:
                        rh = replace(req, hw=req.hw_of(pt))
                        one = pool_placement.independent_plan(rh, p, d)
                        plans += ([one] if one else []) + pool_placement.co_node_plans(rh, p, d)
                    else:
                        one = _cross(req, p, d, math.ceil(req.rate / p.goodput), math.ceil(req.rate / d.goodput))
                        plans += [one] if one else []
        for c in pk["colocated"]:
            one = pool_placement.colocated_plan(replace(req, hw=req.hw_of(pt)), c)
            plans += [one] if one else []
    return plans


def _spend(req: PlanRequest, plan: Plan, budget: Budget) -> float:
    value = (plan_cost if budget.kind == "cost" else plan_power)(plan, req.hw_of)
    assert value is not None, "cost.require checks the numbers first"
    return value


def budget_candidates(req: PlanRequest, phases: dict, budget: Budget) -> tuple[list[Plan], Plan | None]:
    """Per family and instance kinds, the replica split with the most goodput within the budget (step 3,
    budget mode); also the cheapest design of all (for the error when none fits)."""
    plans, cheapest = [], None
    for pt, pk in phases.items():
        for dt, dk in phases.items():
            for p in pk["prefill"]:
                for d in dk["decode"]:
                    best = None
                    for a in range(1, req.total_gpus // p.parallel.gpus + 1):
                        b = min(req.total_gpus // d.parallel.gpus, math.ceil(a * p.goodput / d.goodput))
                        one = _cross(req, p, d, a, max(1, b)) if pt != dt else _same_type(req, p, d, a, max(1, b))
                        while one is not None and _spend(req, one, budget) > budget.limit and one.pools[1][1] > 1:
                            one = pool_placement.resized_plan(req, one, [(p, a), (d, one.pools[1][1] - 1)])
                        if one is None:
                            continue
                        if cheapest is None or _spend(req, one, budget) < _spend(req, cheapest, budget):
                            cheapest = one
                        if _spend(req, one, budget) <= budget.limit and (best is None or one.goodput > best.goodput):
                            best = one
                    plans += [best] if best else []
        for c in pk["colocated"]:
            rh = replace(req, hw=req.hw_of(pt))
            top = pool_placement.colocated_plan(replace(rh, rate=c.goodput * rh.total_gpus), c)
            for n in range(top.pools[0][1] if top else 0, 0, -1):
                one = Plan("colocated", "colocated", ((c, n),), n * c.parallel.gpus)
                if cheapest is None or _spend(req, one, budget) < _spend(req, cheapest, budget):
                    cheapest = one
                if _spend(req, one, budget) <= budget.limit:
                    plans.append(one)
                    break
    return plans, cheapest


def _same_type(req: PlanRequest, p: PhaseChoice, d: PhaseChoice, a: int, b: int) -> Plan | None:
    hw = req.hw_of(p.hardware)
    bw = (hw.inter_node_bw if req.nodes > 1 else hw.intra_node_bw) * min(p.parallel.gpus, d.parallel.gpus)
    shell = Plan("disaggregated", "independent", ((p, 1), (d, 1)), p.parallel.gpus + d.parallel.gpus, bw)
    return pool_placement.resized_plan(req, shell, [(p, a), (d, b)])


def _design(req: PlanRequest, plan: Plan, goodput: float) -> Design:
    kinds = {c.hardware for c, _ in plan.pools}
    return Design(_family(plan), plan, plan_cost(plan, req.hw_of), plan_power(plan, req.hw_of), goodput,
                  len(kinds) == 1)


def _verify_rate(req: PlanRequest, plans: list[Plan], objective: str) -> list[Design]:
    """Each family's best candidates by the objective simulated whole at the rate (step 4, rate mode)."""
    def key(p: Plan):
        return objective_key(objective, p, plan_cost(p, req.hw_of), plan_power(p, req.hw_of))

    designs = []
    for fam in dict.fromkeys(_family(p) for p in plans):
        mine = sorted((p for p in plans if _family(p) == fam and p.goodput >= req.rate), key=key)
        passing = []
        for plan in mine[:req.verify_per_mode]:
            runs = pool_placement.bumped_until_ok(req, plan)
            passing += [r for r in runs if r.attainment >= req.slo.attainment]
        if passing:
            shrunk = pool_placement.shrunk_plans(req, min(passing, key=key))
            passing += [r for r in shrunk if r.attainment >= req.slo.attainment]
            best = min(passing, key=key)
            designs.append(_design(req, best, best.goodput))
    return designs


def plan_designs(req: PlanRequest, hws: list[Hardware], objective: str = "gpus", budget: Budget | None = None,
                 measured: tuple[dict, list[str]] | None = None) -> DesignResult:
    """`measured`: step 1's result (`measure_types`) when the caller has it (prices and power do not
    change per-instance goodputs: tests and benches re-rank without re-measuring)."""
    start = time.perf_counter()
    req = replace(req, types=tuple(hws), hw=hws[0])
    phases, rejected = measured or measure_types(req, hws)
    all_phases = tuple(c for kinds in phases.values() for cs in kinds.values() for c in cs)
    if budget is None:
        designs = _verify_rate(req, rate_candidates(req, phases), objective)
        if not designs:
            raise InfeasibleSLOError(f"no design on {', '.join(h.name for h in hws)} serves {req.rate:g} req/s at "
                                     f"the SLO within {req.nodes} x {req.gpus_per_node} devices per type in the "
                                     f"whole-plan simulation", f"a lower --rate or --nodes {req.nodes + 1}")
        designs.sort(key=lambda x: objective_key(objective, x.plan, x.cost, x.power))
    else:
        plans, cheapest = budget_candidates(req, phases, budget)
        if not plans:
            raise _budget_error(req, budget, cheapest)
        best_of: dict[str, Plan] = {}
        for p in sorted(plans, key=lambda p: (-p.goodput, _spend(req, p, budget))):
            best_of.setdefault(_family(p), p)
        designs = [_design(req, p, PlanProbe(req, p).goodput()) for p in best_of.values()]
        designs.sort(key=lambda x: (-x.goodput, _spend(req, x.plan, budget)))
    designs = [replace(d, label=f"D{k + 1}") for k, d in enumerate(designs)]
    return DesignResult(designs[0], tuple(designs), all_phases, objective, budget, time.perf_counter() - start,
                        tuple(rejected))


def _budget_error(req: PlanRequest, budget: Budget, cheapest: Plan | None) -> PlannerError:
    if cheapest is None:
        return PlannerError(f"{budget.flag} {budget.limit:g}: no design fits {req.nodes} x {req.gpus_per_node} "
                            f"devices per type; give more --nodes")
    need = _spend(req, cheapest, budget)
    return PlannerError(f"{budget.flag} {budget.limit:g}: no design fits within it; the cheapest design "
                        f"({cheapest.describe()}) needs {budget.describe(need)}: give {budget.flag} "
                        f"{math.ceil(need * 100) / 100:g} or more")
