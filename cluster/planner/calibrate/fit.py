"""Least-squares fits of DistServe's latency forms (numpy; used by the profiler, not the pure core).

    fit_prefill([(T, SQ, seconds), ...]) -> Fit   t = a + b*T + c*SQ
    fit_decode([(B, C, seconds), ...])   -> Fit   t = a + b*C + c*B

Minimises relative error (each row divided by its time): short steps matter as much as long ones for
TPOT. Coefficients are kept non-negative (a negative one is noise, and would predict negative times
outside the grid): the most negative is pinned at 0 and the rest refitted.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Fit:
    coeffs: tuple[float, float, float]
    mean_rel_err: float
    max_rel_err: float
    points: int

    def as_dict(self) -> dict:
        return {"mean_rel_err": round(self.mean_rel_err, 4), "max_rel_err": round(self.max_rel_err, 4),
                "points": self.points}


def nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Coefficients >= 0 minimising the relative error of x @ coef against y (also used by `gpu_fit`)."""
    w = 1.0 / y
    free = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while free:
        sol, *_ = np.linalg.lstsq(x[:, free] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all():
            coef[free] = sol
            break
        free.pop(int(np.argmin(sol)))
    return coef


def _fit(features: list[tuple[float, float]], times: list[float]) -> Fit:
    if len(times) < 3:
        raise ValueError(f"need at least 3 measurements to fit 3 coefficients (got {len(times)})")
    x = np.array([[1.0, f1, f2] for f1, f2 in features])
    y = np.array(times, dtype=float)
    coef = nonneg_lstsq(x, y)
    rel = np.abs(x @ coef - y) / y
    return Fit((float(coef[0]), float(coef[1]), float(coef[2])), float(rel.mean()), float(rel.max()), len(y))


def fit_prefill(points: list[tuple[float, float, float]]) -> Fit:
    """(total tokens, sum of squared lengths, seconds) -> a, b, c of t = a + b*T + c*SQ."""
    return _fit([(t, sq) for t, sq, _ in points], [s for _, _, s in points])


def fit_decode(points: list[tuple[float, float, float]]) -> Fit:
    """(batch, total context, seconds) -> a, b, c of t = a + b*C + c*B."""
    return _fit([(c, b) for b, c, _ in points], [s for _, _, s in points])
