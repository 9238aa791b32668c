"""What a simulation returns: per-request TTFT/TPOT/e2e, SLO attainment and percentiles.

TTFT ends when prefill returns the first token; TPOT = (e2e - TTFT) / (output_len - 1), so KV transfer
and decode queueing count against TPOT as a client sees them (DistServe's definition). A request with
one output token meets any TPOT. `SimResult.attainment(slo)` is the fraction meeting both targets.
Percentiles are `cluster.stats.percentile` (linear, numpy's default), as the bench reports its measurements.

An SLO is one interface, `share_met(results, metrics)` compared with its `attainment`: here absolute
TTFT/TPOT seconds met by a fraction of requests (DistServe's, the planner's own). The Splitwise
reproduction subclasses it with per-request slowdown bounds (bench/repro/splitwise/slo.py), which is why
a result carries its request's lengths.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from cluster.stats import percentile


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float
    attainment: float = 0.9  # fraction of requests that must meet both

    def share_met(self, results, metrics: tuple[str, ...] = ("ttft", "tpot")) -> float:
        """Fraction of requests meeting every target named in `metrics` (ttft, tpot)."""
        ok = sum(1 for r in results if ("ttft" not in metrics or r.ttft <= self.ttft_s)
                 and ("tpot" not in metrics or r.tpot <= self.tpot_s))
        return ok / len(results)


class RequestResult(NamedTuple):
    """Seconds. A NamedTuple for speed (thousands per simulation), immutable like the dataclasses."""
    arrival: float
    ttft: float
    tpot: float
    e2e: float
    input_len: int = 0  # the request's lengths, for slowdown targets (bench/repro/splitwise/slo.py)
    output_len: int = 0


@dataclass(frozen=True)
class SimResult:
    results: tuple[RequestResult, ...]
    duration: float  # last completion time (seconds)

    def attainment(self, slo: SLO) -> float:
        return slo.share_met(self.results, ("ttft", "tpot"))

    def ttft_attainment(self, slo: SLO) -> float:
        return slo.share_met(self.results, ("ttft",))

    def tpot_attainment(self, slo: SLO) -> float:
        return slo.share_met(self.results, ("tpot",))

    def percentiles(self, qs=(50, 90, 99)) -> dict[str, float]:
        out = {}
        for name in ("ttft", "tpot", "e2e"):
            vals = [getattr(r, name) for r in self.results]
            out.update({f"{name}_p{q}": percentile(vals, q) for q in qs})
        return out

    def binding(self, slo: SLO) -> str:
        """Which target fails more often: "ttft" or "tpot"."""
        return "ttft" if self.ttft_attainment(slo) <= self.tpot_attainment(slo) else "tpot"
