"""Splitwise's per-request slowdown SLO (ISCA'24; reproduction only, bench/repro/splitwise/).

    SlowdownSLO   each request's TTFT, TBT and end-to-end time over its own time alone on a reference
                  machine, bounded at several percentiles (Splitwise's: P50/P90/P99 of each slowdown);
                  its share is the worst (fraction within the bound / the percentile), so 1.0 means all met.

It is an `SLO` (cluster/planner/sim/metrics.py): the planner's goodput bisection and whole-plan checks
take it unchanged through `share_met`. Pure Python.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from cluster.planner.sim.metrics import SLO


# Splitwise's slowdown bounds (splitwise-sim notebooks, get_slo): (metric, percentile, x its time alone)
SPLITWISE_BOUNDS = (("ttft", 50, 2.0), ("ttft", 90, 3.0), ("ttft", 99, 6.0), ("tbt", 50, 1.25), ("tbt", 90, 1.5),
                    ("tbt", 99, 5.0), ("e2e", 50, 1.25), ("e2e", 90, 1.5), ("e2e", 99, 5.0))


@dataclass(frozen=True)
class SlowdownSLO(SLO):
    """Per-request slowdowns against the request alone on a reference machine. `ttft_s`/`tpot_s` stay
    absolute stand-ins (for hints and token budgets); `attainment` is 1.0: every bound met.
    `alone_ttft(prompt)` and `alone_tbt(prompt)` are the reference's prompt time and batch-1 token time.
    The TPOT target ("tpot") covers the TBT and end-to-end bounds; "ttft" the TTFT ones.
    `tbt_over_all_tokens`: a request's TBT is its time after the first token over all its output tokens,
    as splitwise-sim computes it (scheduler.py), instead of over the gaps between them."""
    alone_ttft: Callable[[int], float] = lambda n: 1.0
    alone_tbt: Callable[[int], float] = lambda n: 1.0
    bounds: tuple[tuple[str, int, float], ...] = SPLITWISE_BOUNDS
    attainment: float = 1.0
    tbt_over_all_tokens: bool = False

    def only(self, *metrics: str) -> "SlowdownSLO":
        """The bounds on `metrics` alone (ttft, tbt, e2e): one phase measured by itself."""
        return replace(self, bounds=tuple(b for b in self.bounds if b[0] in metrics))

    def slowdowns(self, results, metric: str) -> list[float]:
        out = []
        for r in results:
            t1, b1 = self.alone_ttft(r.input_len), self.alone_tbt(r.input_len)
            if metric == "ttft":
                out.append(r.ttft / t1)
            elif metric == "tbt":
                gaps = max(0, r.output_len - 1)
                tbt = r.tpot * gaps / max(1, r.output_len) if self.tbt_over_all_tokens else r.tpot
                out.append(tbt / b1)
            else:
                out.append(r.e2e / (t1 + b1 * max(0, r.output_len - 1)))
        return out

    def share_met(self, results, metrics: tuple[str, ...] = ("ttft", "tpot")) -> float:
        names = {"ttft": ("ttft",), "tpot": ("tbt", "e2e")}
        wanted = {m for k in metrics for m in names[k]}
        worst, cache = 1.0, {}
        for metric, q, x in self.bounds:
            if metric in wanted:
                if metric not in cache:
                    cache[metric] = self.slowdowns(results, metric)
                s = cache[metric]
                worst = min(worst, sum(1 for v in s if v <= x) / len(s) / (q / 100))
        return worst
