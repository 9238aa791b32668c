"""The machine's drift and the serving factors, as the simulators apply them (pure Python).

    Drift                       step-time multipliers that wander with simulated time (seeded windows)
    drift_factor / drift_horizon  what `sim/disagg.py` and `sim/coloc.py` ask a latency model's drift
    drift_of(entry), scaled(coeffs, entry)  a profile's serving entry as a Drift and scaled coefficients
                                (`latency/profiles.py`)

Why and how the entry is measured: `calibrate/serving_fit.py` (a `pdserve bench` run's timelines). Each
kind's simulated time is cut into windows of the span its spread was measured over; each window draws
one quantile (seeded: a run is still a pure function of its inputs) and every step of that kind starting
in it, on every instance, is scaled by it.
"""
from __future__ import annotations

import functools
import random
from dataclasses import dataclass

from cluster.planner.latency.base import Coeffs

SPREAD_POINTS = 21  # quantiles at 0, 5, ..., 100%
KINDS = ("prefill", "decode")
MODES = ("disaggregated", "colocated")


@dataclass(frozen=True)
class Drift:
    """Step-time multipliers that wander with simulated time (see the module map)."""
    prefill: tuple[float, ...]  # quantiles of a prefill's time / its median, evenly spaced from 0 to 100%
    decode: tuple[float, ...]  # the same for TPOT
    prefill_window_s: float
    decode_window_s: float
    seed: int = 0

    def factor(self, kind: str, t: float) -> float:
        q, w = (self.prefill, self.prefill_window_s) if kind == "prefill" else (self.decode, self.decode_window_s)
        return at_fraction(q, _draw(self.seed, KINDS.index(kind), int(t // w)))

    def next_change(self, kind: str, t: float) -> float:
        """When the factor of `kind` may change next: decode steps summed in closed form stop there."""
        w = self.prefill_window_s if kind == "prefill" else self.decode_window_s
        return (int(t // w) + 1) * w


def at_fraction(values, u: float) -> float:
    """Linear interpolation into sorted `values` at fraction u in [0, 1] of the way along."""
    x = u * (len(values) - 1)
    i = min(int(x), len(values) - 2)
    return values[i] + (values[i + 1] - values[i]) * (x - i)


@functools.lru_cache(maxsize=8192)
def _draw(seed: int, kind: int, window: int) -> float:
    return random.Random((seed * 2 + kind) * 1_000_003 + window).random()


def drift_factor(model, kind: str, t: float) -> float:
    """The drift multiplier of `model` (a LatencyModel) for a step of `kind` starting at t (1: none)."""
    return 1.0 if model.drift is None else model.drift.factor(kind, t)


def drift_horizon(model, kind: str, t: float) -> float:
    """When `model`'s drift factor of `kind` may change next after t (inf: never)."""
    return float("inf") if model.drift is None else model.drift.next_change(kind, t)


def drift_of(entry) -> Drift | None:
    """The profile's serving entry as a `Drift` (None without spreads)."""
    if not entry.prefill_spread or not entry.decode_spread:
        return None
    return Drift(tuple(entry.prefill_spread), tuple(entry.decode_spread), entry.prefill_window_s, entry.decode_window_s)


def scaled(coeffs: Coeffs, entry) -> Coeffs:
    """The fitted coefficients times the serving factors (`entry`: the profile's serving entry)."""
    return Coeffs(tuple(x * entry.prefill_factor for x in coeffs.prefill),
                  tuple(x * entry.decode_factor for x in coeffs.decode))
