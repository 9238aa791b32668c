"""The one `percentile` of pdserve's reports: the bench's summaries and QoE, the planner's simulated
percentiles and its workload lines, and the checks that compare the two.

Definition: linear interpolation between the closest ranks, numpy's default (`np.percentile(values, q)`,
method "linear"), which is what `vllm bench serve` reports and what a reader comparing our p90 with another
tool's expects. Nearest rank (the planner's former definition) answers differently on small samples
(p50 of [1, 2, 3, 4]: 2.5 here, 2 by nearest rank). Pure Python, no imports of pdserve.
"""
from __future__ import annotations

import math


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]; nan for no values."""
    if not values:
        return math.nan
    v = sorted(values)
    pos = (len(v) - 1) * q / 100.0
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)
