"""What a simulation returns: per-request TTFT/TPOT/e2e, SLO attainment and percentiles.

TTFT ends when prefill returns the first token; TPOT = (e2e - TTFT) / (output_len - 1), so KV transfer
and decode queueing count against TPOT as a client sees them (DistServe's definition). A request with
one output token meets any TPOT. `SimResult.attainment(slo)` is the fraction meeting both targets.

Two kinds of target, one interface (`share_met(results, metrics)`, compared with the SLO's `attainment`):
  SLO           absolute TTFT/TPOT seconds met by a fraction of requests (DistServe's, the planner's own);
  SlowdownSLO   each request's TTFT, TBT and end-to-end time over its own time alone on a reference
                machine, bounded at several percentiles (Splitwise's: P50/P90/P99 of each slowdown);
                its share is the worst (fraction within the bound / the percentile), so 1.0 means all met.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, NamedTuple


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


class RequestResult(NamedTuple):
    """Seconds. A NamedTuple for speed (thousands per simulation), immutable like the dataclasses."""
    arrival: float
    ttft: float
    tpot: float
    e2e: float
    input_len: int = 0  # the request's lengths, for slowdown targets (SlowdownSLO)
    output_len: int = 0


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    s = sorted(values)
    k = min(len(s) - 1, max(0, int(round(q / 100 * len(s) + 0.5)) - 1))
    return s[k]


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
