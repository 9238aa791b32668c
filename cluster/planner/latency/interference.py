"""Co-run interference factors: how much slower a step runs while a neighbour on its node is mid-step.

`pdserve profile` measures them (`calibrate/corun.py`, the profile's `corun` entry); `latency/profiles.py`
reads them into a `Corun`; the simulators apply them through a node's bus (`sim/bus.py`). GPUs keep factor
1 (each device has its own HBM) unless a profile says otherwise. Pure Python.
"""
from __future__ import annotations

from dataclasses import dataclass

KINDS = ("prefill", "decode")


@dataclass(frozen=True)
class Corun:
    """slowdown[(kind, neighbour kind)] >= 0; a missing pair is 1 (no interference)."""
    pairs: tuple[tuple[str, str, float], ...] = ()

    @staticmethod
    def none() -> "Corun":
        return Corun(())

    @staticmethod
    def from_dict(slowdown: dict[str, float]) -> "Corun":
        """From the profile's `{"decode_beside_prefill": 1.1, ...}` keys."""
        pairs = []
        for key, f in sorted(slowdown.items()):
            kind, _, other = key.partition("_beside_")
            assert kind in KINDS and other in KINDS, f"corun key {key!r}"  # the profile loader checked it
            pairs.append((kind, other, float(f)))
        return Corun(tuple(pairs))

    @property
    def is_none(self) -> bool:
        return all(f == 1.0 for _, _, f in self.pairs)

    def factor(self, kind: str, other: str) -> float:
        return next((f for k, o, f in self.pairs if k == kind and o == other), 1.0)
