"""Andes QoE: how a reader of a streamed response experiences its token delivery. Pure, no clock.

Definition (Liu et al., "Andes: Defining and Enhancing Quality-of-Experience in LLM-Based Text Streaming
Services", arXiv 2404.16283, Section 3.1, Eq. 1). A reader expects the first token `ttft_s` after sending
and then `tds` tokens per second (the expected token delivery speed, a reading pace):

    T(t) = clamp(tds * (t - ttft_s), 0, l)         expected tokens read by t; l = tokens in the response
    A(t) = tokens actually read by t: a token is read no earlier than it arrived and no earlier than its
           expected time (tokens ahead of the pace wait in the client's buffer), and never faster than
           `tds` (the slope of A is capped): early delivery adds nothing, a late one leaves A below T
    QoE  = S_actual / S_expected = integral_0^X A(t) dt / integral_0^X T(t) dt

X is the time the reader reaches the last token (A(X) = l). The paper writes X as the time to the last
token; we read it as the reader's last token, the reading under which the paper's second principle
(delivering faster than the reader reads changes nothing) holds: with the server's last-token time
instead, a server that bursts the rest of a response after a stall would end the integral sooner and
score lower than one that trickles it out at the reading pace. With this X the ratio is also
1 - (area between the curves) / (area under T), the lag of every token summed:

    token i (0-based) is expected from e_i = ttft_s + i / tds, read from b_i = max(arrival_i, e_i,
    b_{i-1} + 1/tds) for 1/tds seconds;  lag = sum_i (b_i - e_i);  X = b_{l-1} + 1/tds
    S_expected = sum_i (X - e_i) - l / (2 tds)      (each token's ramp counts half its read time)
    QoE = 1 - lag / S_expected                      in (0, 1]; 1 exactly when no token was read late

A later first token, or a stall the buffer cannot absorb, delays every token read after it: the reader
reads at the pace, so a lag persists until the end (the paper's "cascading delays"). The paper's optional
TTFT penalty (alpha ** (TTFT - ttft_s)) is not applied.

Defaults: 4.8 tokens/s, the human reading speed the paper measures against (its Section 2.2), and an
expected TTFT of 1 s. A failed request (an error, no token) scores 0, as it misses an SLO in attainment.

    qoe([1.0, 1.5, 4.0, 4.0], ttft_s=1.0, tds=2.0)      # -> 2/3 (a stall half-way)
    request_qoe(record, QoESetting())                   # a bench RequestRecord; 0.0 if it failed
    qoe_stats([request_qoe(r, s) for r in records])     # mean, percentiles, share >= GOOD
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from cluster.bench.record import RequestRecord
from cluster.stats import percentile

READING_TDS = 4.8  # tokens/s: human reading speed in the Andes paper (listening: 3.3)
EXPECTED_TTFT_S = 1.0
GOOD = 0.9  # the Andes evaluation's cut for an acceptable QoE; summaries report the share at or above it


@dataclass(frozen=True)
class QoESetting:
    ttft_s: float = EXPECTED_TTFT_S  # expected time to first token, seconds after the request was sent
    tds: float = READING_TDS  # expected token delivery speed (reading pace), tokens/s

    def __post_init__(self):
        if not (self.tds > 0 and math.isfinite(self.tds)):
            raise ValueError(f"the QoE pace must be > 0 tokens/s, got {self.tds!r}")
        if not (self.ttft_s >= 0 and math.isfinite(self.ttft_s)):
            raise ValueError(f"the expected QoE TTFT must be >= 0 s, got {self.ttft_s!r}")


def qoe(arrivals_s: list[float], ttft_s: float = EXPECTED_TTFT_S, tds: float = READING_TDS) -> float:
    """QoE of one response whose tokens arrived at `arrivals_s` (seconds after the request was sent,
    one entry per token, non-decreasing; tokens of one chunk share its time)."""
    QoESetting(ttft_s, tds)  # validates
    if not arrivals_s:
        raise ValueError("QoE needs at least one token arrival time (a failed request scores 0)")
    per_token = 1.0 / tds
    lag = 0.0
    read_from = -math.inf  # b_{i-1}
    expected: list[float] = []
    for i, arrived in enumerate(arrivals_s):
        if i and arrived < arrivals_s[i - 1]:
            raise ValueError(f"token arrival times must not decrease: token {i} at {arrived} after "
                             f"{arrivals_s[i - 1]}")
        e = ttft_s + i * per_token
        read_from = max(arrived, e, read_from + per_token)
        lag += read_from - e
        expected.append(e)
    end = read_from + per_token  # X: the reader has read the last token
    s_expected = sum(end - e for e in expected) - len(expected) * per_token / 2.0
    return max(0.0, 1.0 - lag / s_expected)  # s_expected >= l / (2 tds) > 0


def token_arrivals(r: RequestRecord) -> list[float]:
    """Per token, its chunk's arrival time relative to the send (a chunk of n tokens gives n entries)."""
    if r.sent_s is None:
        return []
    return [t - r.sent_s for t, n in zip(r.chunk_s, r.chunk_tokens) for _ in range(n)]


def request_qoe(r: RequestRecord, setting: QoESetting) -> float:
    """QoE of a bench record: 0.0 for a failed request, else `qoe` of its token arrivals."""
    arrivals = token_arrivals(r) if r.ok else []
    return qoe(arrivals, setting.ttft_s, setting.tds) if arrivals else 0.0


def qoe_stats(values: list[float]) -> dict[str, float]:
    """Mean, low percentiles (the unhappy readers are the low tail), min, and the share >= GOOD."""
    n = len(values)
    return {"mean": sum(values) / n if n else math.nan, "p10": percentile(values, 10),
            "p50": percentile(values, 50), "p90": percentile(values, 90),
            "min": min(values) if n else math.nan,
            "share_good": sum(v >= GOOD for v in values) / n if n else math.nan}
