"""Whole-plan goodput: one plan simulated whole at rising rates (`PlanProbe`), cached by rate.

Who calls: the report (`emit/report.py`: the chosen plan's curve and goodput), the design search in budget
mode (`designs.py`) and its report (`emit/design_report.py`). Pure Python.
"""
from __future__ import annotations

from cluster.planner.search.goodput import REPORT, bisect_rate
from cluster.planner.search.plans import Plan
from cluster.planner.search.pool_placement import simulate_plan
from cluster.planner.search.request import PlanRequest

RATE_FACTORS = (0.5, 0.75, 1.0, 1.25, 1.5)


class PlanProbe:
    """Whole-plan simulations of one plan, cached by rate: its goodput (bisection) and its curve."""

    def __init__(self, req: PlanRequest, plan: Plan):
        self.req, self.plan, self.cache = req, plan, {}

    def attainment(self, rate: float) -> float:
        if rate not in self.cache:
            self.cache[rate] = simulate_plan(self.req, self.plan, rate, REPORT).attainment(self.req.slo)
        return self.cache[rate]

    def goodput(self) -> float:
        """The highest rate the whole plan serves at the attainment target (5% resolution)."""
        ok = self.plan.attainment is not None and self.plan.attainment >= self.req.slo.attainment
        guess = max(self.plan.goodput, self.req.rate) if ok else self.plan.goodput
        return bisect_rate(self.attainment, self.req.slo.attainment, guess, REPORT.rel_tol, warm=True)[0]

    def curve(self) -> list[tuple[float, float]]:
        return [(self.req.rate * f, self.attainment(self.req.rate * f)) for f in RATE_FACTORS]
