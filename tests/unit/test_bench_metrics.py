"""cluster/bench/metrics.py from synthetic event logs with known answers: TTFT/TPOT/e2e, attainment with
failed and 1-token requests, percentiles, and the goodput search on fake attainment functions."""
from __future__ import annotations

import math

import pytest

from cluster.bench.metrics import (RatePoint, RequestRecord, attainment, find_goodput, goodput_from_points,
                                   meets, request_metrics, summarize)
from cluster.stats import percentile


def rec(index, sent, chunks, tokens=None, end=None, error=None, output_tokens=None):
    """A record sent at `sent` whose token-carrying chunks arrived at `chunks` (one token each unless
    `tokens` says otherwise)."""
    tokens = tokens or [1] * len(chunks)
    return RequestRecord(index, sent, 100, sum(tokens), sent_s=sent, chunk_s=list(chunks), chunk_tokens=tokens,
                         end_s=end if end is not None else (chunks[-1] if chunks else sent + 1.0),
                         output_tokens=sum(tokens) if output_tokens is None else output_tokens, error=error)


def test_ttft_tpot_e2e_known_answers():
    m = request_metrics(rec(0, 1.0, [1.5, 1.6, 1.7, 1.9], end=2.0))
    assert m.ok and m.ttft_s == pytest.approx(0.5)
    assert m.tpot_s == pytest.approx((1.9 - 1.5) / 3)  # 4 tokens: 3 gaps after the first
    assert m.e2e_s == pytest.approx(1.0) and m.output_tokens == 4


def test_tpot_counts_tokens_not_chunks():
    # 1 + 3 + 4 tokens in 3 chunks (draft-verify or a server batching its stream): 7 gaps after the first
    m = request_metrics(rec(0, 0.0, [0.2, 0.5, 0.9], tokens=[1, 3, 4]))
    assert m.output_tokens == 8 and m.tpot_s == pytest.approx(0.7 / 7)
    # a foreign server whose usage says 8 tokens but streamed 4 text chunks: usage wins
    m = request_metrics(rec(1, 0.0, [0.2, 0.4, 0.6, 0.9], output_tokens=8))
    assert m.tpot_s == pytest.approx(0.7 / 7)


def test_one_token_request_has_no_tpot_and_is_judged_on_ttft():
    m = request_metrics(rec(0, 0.0, [0.3]))
    assert m.ok and m.tpot_s is None and m.ttft_s == pytest.approx(0.3)
    assert meets(m, ttft_slo_s=0.5, tpot_slo_s=1e-9)  # no gap can miss the TPOT target
    assert not meets(m, ttft_slo_s=0.2, tpot_slo_s=10.0)


def test_failed_requests_miss_the_slo_and_count_in_the_denominator():
    good = rec(0, 0.0, [0.1, 0.2])
    http_error = rec(1, 0.0, [], error="HTTP 429: queue full")
    mid_stream = rec(2, 0.0, [0.1, 0.2], error="stream error: boom")  # tokens came, then an error
    no_tokens = rec(3, 0.0, [])
    ms = [request_metrics(r) for r in (good, http_error, mid_stream, no_tokens)]
    assert [m.ok for m in ms] == [True, False, False, False]
    assert all(m.ttft_s is None and m.tpot_s is None for m in ms[1:])
    assert attainment(ms, 1.0, 1.0) == pytest.approx(0.25)
    assert attainment([], 1.0, 1.0) == 0.0


def test_attainment_needs_both_targets():
    fast_first_slow_rest = rec(0, 0.0, [0.1, 1.1, 2.1])  # TTFT 0.1, TPOT 1.0
    slow_first_fast_rest = rec(1, 0.0, [2.0, 2.1, 2.2])  # TTFT 2.0, TPOT 0.1
    both_fine = rec(2, 0.0, [0.2, 0.3, 0.4])
    single = rec(3, 0.0, [0.4])
    ms = [request_metrics(r) for r in (fast_first_slow_rest, slow_first_fast_rest, both_fine, single)]
    assert attainment(ms, ttft_slo_s=0.5, tpot_slo_s=0.5) == pytest.approx(0.5)  # both_fine + single
    assert attainment(ms, ttft_slo_s=3.0, tpot_slo_s=0.5) == pytest.approx(0.75)
    assert attainment(ms, ttft_slo_s=3.0, tpot_slo_s=2.0) == pytest.approx(1.0)
    # exactly at the target meets it
    assert attainment(ms[2:3], ttft_slo_s=0.2, tpot_slo_s=0.1 + 1e-12) == 1.0


def test_percentile_matches_numpy_linear():
    vals = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(vals, 50) == 3.0
    assert percentile(vals, 90) == pytest.approx(4.6)
    assert percentile(vals, 0) == 1.0 and percentile(vals, 100) == 5.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5  # between the middle two (nearest rank said 2.0)
    assert math.isnan(percentile([], 50))
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        xs = rng.exponential(size=n).tolist()
        for q in (0, 10, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12, abs=1e-15)


def test_summary_counts_and_throughput():
    rs = [rec(0, 0.0, [0.5, 1.0], end=1.0), rec(1, 1.0, [1.5, 2.0, 2.5, 3.0], end=3.0),
          rec(2, 2.0, [], error="HTTP 500: x", end=2.1)]
    s = summarize(rs, ttft_slo_s=0.6, tpot_slo_s=0.6)
    assert (s.requests, s.completed, s.failed) == (3, 2, 1)
    assert s.attainment == pytest.approx(2 / 3)
    assert s.output_tokens == 6 and s.duration_s == pytest.approx(3.0)
    assert s.request_throughput == pytest.approx(2 / 3) and s.output_throughput == pytest.approx(2.0)
    assert s.ttft_ms["p50"] == pytest.approx(500.0) and s.tpot_ms["max"] == pytest.approx(500.0)


# ---- goodput ----------------------------------------------------------------------------------
def test_goodput_from_points():
    pts = [RatePoint(1, 1.0), RatePoint(2, 0.95), RatePoint(4, 0.5), RatePoint(8, 0.1)]
    assert goodput_from_points(pts, 0.9) == (2, None)
    # crossing placed linearly between 2 (0.95) and 4 (0.5): 2 + 2 * 0.05 / 0.45
    assert goodput_from_points(pts, 0.9, interpolate=True)[0] == pytest.approx(2 + 2 * 0.05 / 0.45)
    assert goodput_from_points(pts, 0.4) == (4, None)
    assert goodput_from_points(pts[:2], 0.9) == (2, "above")  # never failed: a lower bound
    assert goodput_from_points([RatePoint(1, 0.8)], 0.9) == (0.0, None)
    # a noisy point that attains above a failing one does not count: lower rates must attain too
    assert goodput_from_points([RatePoint(1, 0.95), RatePoint(2, 0.7), RatePoint(3, 0.92)], 0.9) == (1, None)


def test_find_goodput_bisects_to_a_known_capacity():
    capacity = 3.3  # the fake server attains while rate <= capacity
    calls = []

    def measure(rate):
        calls.append(rate)
        return 1.0 if rate <= capacity else 0.6

    res = find_goodput(measure, [1, 2, 4], target=0.9, bisect_steps=10, rel_tol=0.01)
    assert 3.3 * 0.99 <= res.goodput <= 3.3 and res.bound is None
    assert calls[:3] == [1, 2, 4] and len(calls) == len(set(calls))  # each rate measured once
    assert all((a >= 0.9) == (p.rate <= capacity) for p in res.points for a in [p.attainment])


def test_find_goodput_stops_on_deep_overload_and_expands_when_everything_attains():
    calls = []

    def measure(rate):
        calls.append(rate)
        return max(0.0, 1.0 - rate / 10)  # attainment 0.9 at rate 1

    res = find_goodput(measure, [0.5, 8, 16, 32], target=0.9, bisect_steps=0, stop_below=0.5)
    assert calls == [0.5, 8]  # 8 attains 0.2 < 0.5: 16 and 32 would only take longer
    assert res.goodput == 0.5
    calls.clear()
    res = find_goodput(lambda r: calls.append(r) or 1.0, [1, 2], target=0.9, bisect_steps=3, expand=2)
    assert calls == [1, 2, 4, 8] and res.goodput == 8 and res.bound == "above"


def test_find_goodput_when_even_the_lowest_rate_fails_bisects_towards_zero():
    res = find_goodput(lambda r: 1.0 if r <= 0.3 else 0.0, [1, 2], target=0.9, bisect_steps=3, stop_below=0.0)
    assert [p.rate for p in res.points] == [0.25, 0.375, 0.5, 1, 2]  # [0,1] -> [0,.5] -> [.25,.5] -> .375
    assert res.goodput == 0.25
    res = find_goodput(lambda r: 0.0, [1], target=0.9, bisect_steps=2, stop_below=0.0)
    assert res.goodput == 0.0 and [p.rate for p in res.points] == [0.25, 0.5, 1]
