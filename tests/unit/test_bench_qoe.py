"""cluster/bench/qoe.py on hand-worked token timelines: Andes QoE = area under the reader's curve A(t) /
area under the expected curve T(t), both up to the moment the reader has read the last token.

Most cases use a pace of 2 tokens/s and an expected TTFT of 1 s, so token i (0-based) is expected from
1 + i/2 s and takes 0.5 s to read; a 4-token response is then read by t = 3 s and the area under
T(t) = clamp(2 (t - 1), 0, 4) up to t = X is 4 (the ramp, 1..3 s) + 4 (X - 3)."""
from __future__ import annotations

import math

import pytest

from cluster.bench.metrics import RequestRecord, summarize
from cluster.bench.qoe import GOOD, QoESetting, qoe, qoe_stats, request_qoe, token_arrivals


def area_under_T(x: float) -> float:  # l = 4, ttft 1 s, 2 tok/s
    return 4.0 + 4.0 * (x - 3.0)


def test_a_stream_at_the_expected_pace_scores_one():
    assert qoe([1.0, 1.5, 2.0, 2.5], ttft_s=1.0, tds=2.0) == pytest.approx(1.0)
    # the paper's defaults: 64 tokens at 4.8 tok/s after 1 s
    assert qoe([1.0 + i / 4.8 for i in range(64)]) == pytest.approx(1.0)


def test_a_stream_faster_than_the_pace_scores_one():
    # everything at 0.2 s: the buffer holds tokens until the reader gets to them; speed adds nothing
    assert qoe([0.2] * 4, ttft_s=1.0, tds=2.0) == pytest.approx(1.0)
    assert qoe([0.9, 0.91, 0.92, 0.93], ttft_s=1.0, tds=2.0) == pytest.approx(1.0)
    # a stall the buffer absorbs: token 3 arrives 0.1 s before the reader needs it
    assert qoe([1.0, 1.0, 1.0, 2.4], ttft_s=1.0, tds=2.0) == pytest.approx(1.0)


def test_a_late_first_token_delays_every_token():
    # first token at 3 s instead of 1 s, then the pace: every token is read 2 s late, the reader is done at
    # 5 s; S_expected = 4 + 4 x 2 = 12; A(t) = clamp(2 (t - 3), 0, 4): S_actual = 4; QoE = 4/12
    assert area_under_T(5.0) == 12.0
    assert qoe([3.0, 3.5, 4.0, 4.5], ttft_s=1.0, tds=2.0) == pytest.approx(1 / 3)
    # the same 2 s late start with the rest in one burst: the reader reads at the pace anyway
    assert qoe([3.0, 3.0, 3.0, 3.0], ttft_s=1.0, tds=2.0) == pytest.approx(1 / 3)


def test_a_stall_half_way():
    # tokens 0, 1 on time (read 1..2 s), tokens 2, 3 arrive at 4 s (read 4..5 s). A(t): 0 -> 2 over
    # 1..2 s (area 1), flat at 2 over 2..4 s (area 4), 2 -> 4 over 4..5 s (area 3): 8; T: 12. QoE = 2/3
    assert qoe([1.0, 1.5, 4.0, 4.0], ttft_s=1.0, tds=2.0) == pytest.approx(2 / 3)
    # token 3 alone late by 0.2 s: read 2.7..3.2 s; lag 0.2 s x 1 token; S_expected = 4 + 4 x 0.2 = 4.8
    assert qoe([1.0, 1.0, 1.0, 2.7], ttft_s=1.0, tds=2.0) == pytest.approx(1 - 0.2 / 4.8)


def test_a_late_token_costs_more_the_earlier_it_comes():
    late_first = qoe([1.5, 1.5, 2.0, 2.5], ttft_s=1.0, tds=2.0)  # 0.5 s late at token 0: all 4 shift
    late_last = qoe([1.0, 1.5, 2.0, 3.0], ttft_s=1.0, tds=2.0)  # 0.5 s late at token 3: only it shifts
    assert late_first == pytest.approx(1 - 4 * 0.5 / area_under_T(3.5))
    assert late_last == pytest.approx(1 - 1 * 0.5 / area_under_T(3.5))
    assert late_first < late_last < 1.0


def test_one_token_response():
    # expected 1..1.5 s (area 0.25 up to 1.5 s, then 1 per s); read 2..2.5 s: S_actual 0.25, S_expected 1.25
    assert qoe([2.0], ttft_s=1.0, tds=2.0) == pytest.approx(0.25 / 1.25)
    assert qoe([0.5], ttft_s=1.0, tds=2.0) == pytest.approx(1.0)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="at least one"):
        qoe([], ttft_s=1.0, tds=2.0)
    with pytest.raises(ValueError, match="must not decrease"):
        qoe([1.0, 0.5], ttft_s=1.0, tds=2.0)
    for ttft, tds in ((1.0, 0.0), (1.0, -2.0), (-1.0, 2.0), (1.0, math.nan)):
        with pytest.raises(ValueError):
            QoESetting(ttft, tds)


def record(sent, chunks, tokens, error=None):
    return RequestRecord(0, sent, 8, sum(tokens), sent_s=sent, chunk_s=list(chunks), chunk_tokens=list(tokens),
                         end_s=(chunks[-1] if chunks else sent + 1), output_tokens=sum(tokens), error=error)


def test_records_expand_chunks_to_tokens_relative_to_the_send_and_failures_score_zero():
    s = QoESetting(ttft_s=1.0, tds=2.0)
    # sent at 10 s; a 1-token chunk at 11 s and a 3-token chunk (draft-verify) at 14 s: the stall case
    r = record(10.0, [11.0, 11.5, 14.0], [1, 1, 2])
    assert token_arrivals(r) == [1.0, 1.5, 4.0, 4.0]
    assert request_qoe(r, s) == pytest.approx(2 / 3)
    assert request_qoe(record(10.0, [11.0], [1], error="HTTP 500: x"), s) == 0.0
    assert request_qoe(record(10.0, [], []), s) == 0.0  # no token


def test_stats_and_summary_count_failed_requests_as_zero():
    st = qoe_stats([1.0, 1.0, 0.5, 0.0])
    assert st["mean"] == pytest.approx(0.625) and st["min"] == 0.0 and st["p50"] == pytest.approx(0.75)
    assert st["share_good"] == pytest.approx(0.5) and GOOD == 0.9
    s = QoESetting(ttft_s=1.0, tds=2.0)
    recs = [record(0.0, [1.0, 1.5, 2.0, 2.5], [1, 1, 1, 1]), record(0.0, [3.0], [4]),
            record(0.0, [], [], error="HTTP 429: busy")]
    summary = summarize(recs, 5.0, 1.0, s)
    assert summary.qoe["mean"] == pytest.approx((1.0 + 1 / 3 + 0.0) / 3)
    assert summary.qoe["share_good"] == pytest.approx(1 / 3)
    assert summarize(recs, 5.0, 1.0).qoe is None  # not asked
