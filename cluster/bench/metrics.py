"""Bench metrics: per-request latencies, SLO attainment, goodput. Pure Python, no network, no clock.

Who calls it: `loadgen.py` produces one `RequestRecord` (`record.py`) per request (client-side times,
seconds from the start of the run); `runner.py` turns records into `RequestMetrics` and `Summary` and searches the goodput
with `find_goodput`; `report.py` reads the same functions to redo attainment at other SLO scales.

Definitions (the ones `vllm bench serve` users expect, measured at the client):
    TTFT  = time of the first chunk carrying an output token - time the request was sent
    TPOT  = (time of the last output token - time of the first) / (output tokens - 1), i.e. the mean gap
            between output tokens after the first; a request with 1 output token has no TPOT (None)
    e2e   = time the stream ended - time the request was sent
    attainment = share of ALL requests (failed ones included) with ok and TTFT <= ttft_slo and
            TPOT <= tpot_slo. A failed request (HTTP error, error event, timeout, no output token)
            misses the SLO. A 1-token request meets the TPOT target by definition (no gap to miss): it
            is judged on TTFT alone.
    percentiles: `cluster.stats.percentile` (linear interpolation, numpy's default, as `vllm bench serve`)
    goodput = the highest request rate at which attainment >= target (default 0.9): `find_goodput`
            measures the given rates, then bisects between the highest rate that attains (every lower
            measured rate attaining too) and the next one that does not.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from cluster.bench.qoe import QoESetting, qoe_stats, request_qoe
from cluster.bench.record import RequestRecord  # its own module (qoe.py reads it too); callers import it here
from cluster.stats import percentile


@dataclass
class RequestMetrics:
    index: int
    ok: bool
    ttft_s: float | None
    tpot_s: float | None  # None: failed, or 1 output token
    e2e_s: float | None
    output_tokens: int


def request_metrics(r: RequestRecord) -> RequestMetrics:
    if not r.ok:
        return RequestMetrics(r.index, False, None, None, None, r.output_tokens)
    ttft = r.chunk_s[0] - r.sent_s
    tpot = (r.chunk_s[-1] - r.chunk_s[0]) / (r.output_tokens - 1) if r.output_tokens > 1 else None
    e2e = (r.end_s if r.end_s is not None else r.chunk_s[-1]) - r.sent_s
    return RequestMetrics(r.index, True, ttft, tpot, e2e, r.output_tokens)


def meets(m: RequestMetrics, ttft_slo_s: float, tpot_slo_s: float) -> bool:
    """Both targets met; a failed request never does, a 1-token request (no TPOT) is judged on TTFT."""
    if not m.ok or m.ttft_s is None or m.ttft_s > ttft_slo_s:
        return False
    return m.tpot_s is None or m.tpot_s <= tpot_slo_s


def attainment(ms: list[RequestMetrics], ttft_slo_s: float, tpot_slo_s: float) -> float:
    if not ms:
        return 0.0
    return sum(meets(m, ttft_slo_s, tpot_slo_s) for m in ms) / len(ms)


def _stats(values: list[float]) -> dict[str, float]:
    mean = sum(values) / len(values) if values else math.nan
    return {"mean": mean, "p50": percentile(values, 50), "p90": percentile(values, 90),
            "p99": percentile(values, 99), "max": max(values) if values else math.nan}


@dataclass
class Summary:
    requests: int
    completed: int
    failed: int
    attainment: float
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    e2e_ms: dict[str, float]
    output_tokens: int
    duration_s: float  # first send to last end
    request_throughput: float  # completed requests / duration
    output_throughput: float  # output tokens / duration
    qoe: dict[str, float] | None = None  # qoe.qoe_stats over all requests (failed ones 0); None: not asked


def summarize(records: list[RequestRecord], ttft_slo_s: float, tpot_slo_s: float,
              qoe: QoESetting | None = None) -> Summary:
    ms = [request_metrics(r) for r in records]
    ok = [m for m in ms if m.ok]
    starts = [r.sent_s for r in records if r.sent_s is not None]
    ends = [r.end_s for r in records if r.end_s is not None]
    duration = max(ends) - min(starts) if starts and ends else 0.0
    out_tokens = sum(m.output_tokens for m in ok)
    ms_of = lambda xs: [1000.0 * x for x in xs if x is not None]  # noqa: E731
    return Summary(
        requests=len(records), completed=len(ok), failed=len(records) - len(ok),
        attainment=attainment(ms, ttft_slo_s, tpot_slo_s),
        ttft_ms=_stats(ms_of(m.ttft_s for m in ok)), tpot_ms=_stats(ms_of(m.tpot_s for m in ok)),
        e2e_ms=_stats(ms_of(m.e2e_s for m in ok)), output_tokens=out_tokens, duration_s=duration,
        request_throughput=len(ok) / duration if duration > 0 else 0.0,
        output_throughput=out_tokens / duration if duration > 0 else 0.0,
        qoe=qoe_stats([request_qoe(r, qoe) for r in records]) if qoe is not None else None)


# ---- goodput ----------------------------------------------------------------------------------
@dataclass
class RatePoint:
    rate: float
    attainment: float


@dataclass
class GoodputResult:
    goodput: float  # highest measured rate attaining (0.0: none did)
    points: list[RatePoint]  # every measured rate, ascending
    bound: str | None = None  # "above": even the highest measured rate attained (goodput is a lower bound)


def goodput_from_points(points: list[RatePoint], target: float, interpolate: bool = False) -> tuple[float, str | None]:
    """The highest rate whose attainment and every lower measured rate's are >= target.

    With `interpolate`, the crossing is placed linearly between that rate and the next (failing) one;
    used to read goodput at other SLO scales off the rates measured for the declared SLO."""
    pts = sorted(points, key=lambda p: p.rate)
    lo, hi = None, None
    for p in pts:
        if p.attainment >= target:
            lo = p
        else:
            hi = p
            break
    if lo is None:
        return 0.0, None
    if hi is None:
        return lo.rate, "above"
    if not interpolate or lo.attainment == hi.attainment:
        return lo.rate, None
    frac = (lo.attainment - target) / (lo.attainment - hi.attainment)
    return lo.rate + frac * (hi.rate - lo.rate), None


def find_goodput(measure: Callable[[float], float], rates: list[float], target: float = 0.9,
                 bisect_steps: int = 3, expand: int = 2, rel_tol: float = 0.05,
                 stop_below: float = 0.5) -> GoodputResult:
    """Measure `rates` ascending (stopping after one whose attainment < stop_below: deeper overload only
    takes longer to drain and says nothing new), double the top rate up to `expand` times while it
    still attains, then bisect the bracket [highest attaining, lowest failing] `bisect_steps` times or
    until it is narrower than rel_tol of its top. `measure(rate) -> attainment` runs one load."""
    assert rates and all(r > 0 for r in rates), rates
    seen: dict[float, float] = {}

    def probe(rate: float) -> float:
        if rate not in seen:
            seen[rate] = measure(rate)
        return seen[rate]

    for r in sorted(set(rates)):
        if probe(r) < stop_below:
            break
    for _ in range(expand):
        lo, hi = _bracket(seen, target)
        if hi is not None or lo is None:
            break
        probe(lo * 2.0)
    for _ in range(bisect_steps):
        lo, hi = _bracket(seen, target)
        if hi is None:
            break
        lo_rate = lo or 0.0
        if (hi - lo_rate) <= rel_tol * hi:
            break
        probe((lo_rate + hi) / 2.0)
    points = [RatePoint(r, a) for r, a in sorted(seen.items())]
    goodput, bound = goodput_from_points(points, target)
    return GoodputResult(goodput, points, bound)


def _bracket(seen: dict[float, float], target: float) -> tuple[float | None, float | None]:
    lo = hi = None
    for rate in sorted(seen):
        if seen[rate] >= target:
            lo = rate
        else:
            hi = rate
            break
    return lo, hi
