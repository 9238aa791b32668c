"""Closed-form runs of decode steps, so simulating a long generation does not cost one event per token.

Between two events a decode batch is fixed (B sequences) and its context grows by B per step, so step j
takes t(j) = max(a1 + b1*(C0 + jB), a2 + b2*(C0 + jB)) (`LatencyModel.decode_lines`). `run_time(k)` sums
k steps exactly; `steps_before(limit)` is the most steps that all end before `limit` seconds (bisection
on the increasing sum). Used by `sim.disagg._Decode` and `sim.coloc.Replica` in decode-only stretches.
"""
from __future__ import annotations

from cluster.planner.latency.base import Line


def _line_sum(p: float, q: float, j0: float, j1: float) -> float:
    """sum of p + q*j for integer j in [j0, j1)."""
    n = j1 - j0
    return n * p + q * (j0 + j1 - 1) * n / 2 if n > 0 else 0.0


class StepRun:
    def __init__(self, lines: tuple[Line, Line], context: float, batch: int):
        (a1, b1), (a2, b2) = lines
        # per step j: p + q*j
        self.l1 = (a1 + b1 * context, b1 * batch)
        self.l2 = (a2 + b2 * context, b2 * batch)

    def step_time(self, j: int) -> float:
        return max(self.l1[0] + self.l1[1] * j, self.l2[0] + self.l2[1] * j)

    def run_time(self, k: int) -> float:
        """Seconds taken by steps 0..k-1."""
        (p1, q1), (p2, q2) = self.l1, self.l2
        if q1 == q2:
            return _line_sum(max(p1, p2), q1, 0, k)
        cross = (p2 - p1) / (q1 - q2)  # where the lines meet; line 1 leads after it iff q1 > q2
        first, second = ((p2, q2), (p1, q1)) if q1 > q2 else ((p1, q1), (p2, q2))
        # `first` leads for j < cross, `second` after (max of two lines is convex)
        split = min(max(0, int(cross) + 1 if cross >= 0 else 0), k)
        return _line_sum(*first, 0, split) + _line_sum(*second, split, k)

    def steps_before(self, limit: float, cap: int) -> int:
        """The most steps k <= cap with run_time(k) < limit. Galloping from 1: under load the answer
        is usually 0 or small, so this is O(log k), not O(log cap)."""
        if cap <= 0 or self.step_time(0) >= limit:
            return 0
        lo, hi = 1, 2  # run_time(lo) < limit
        while hi <= cap and self.run_time(hi) < limit:
            lo, hi = hi, hi * 2
        if hi > cap:
            if self.run_time(cap) < limit:
                return cap
            hi = cap
        while hi - lo > 1:  # run_time(lo) < limit <= run_time(hi)
            mid = (lo + hi) // 2
            if self.run_time(mid) < limit:
                lo = mid
            else:
                hi = mid
        return lo
