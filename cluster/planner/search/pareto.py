"""The Pareto front of designs: `pareto_front(points, senses) -> indices` (pure Python).

A point is a tuple of numbers, one per objective; `senses[k]` is "min" or "max" for objective k. A point is
on the front when no other point is at least as good in every objective and better in one. Points with a
None (a missing price or power) are never on the front. Who calls: `design_report` (the plot's marked
front, the table's column), tests.
"""
from __future__ import annotations

from typing import Sequence


def _better_or_equal(a: float, b: float, sense: str) -> bool:
    return a <= b if sense == "min" else a >= b


def dominates(a: Sequence[float], b: Sequence[float], senses: Sequence[str]) -> bool:
    """True when `a` is at least as good as `b` everywhere and strictly better somewhere."""
    return all(_better_or_equal(x, y, s) for x, y, s in zip(a, b, senses)) and any(x != y for x, y in zip(a, b))


def pareto_front(points: Sequence[Sequence[float | None]], senses: Sequence[str]) -> list[int]:
    """Indices of the non-dominated points, in input order."""
    assert all(s in ("min", "max") for s in senses)
    whole = [k for k, p in enumerate(points) if all(v is not None for v in p)]
    return [k for k in whole if not any(dominates(points[j], points[k], senses) for j in whole if j != k)]
