"""The discrete-event core both simulators share: a time-ordered queue of callbacks.

Ties break by insertion order (a counter), so a run is a pure function of its inputs: deterministic.
"""
from __future__ import annotations

import heapq
import itertools
from typing import Any, Callable


class EventQueue:
    def __init__(self):
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self.now = 0.0

    def at(self, time: float, fn: Callable[..., None], *args: Any) -> None:
        assert time >= self.now - 1e-12, "events cannot be scheduled in the past"
        heapq.heappush(self._heap, (time, next(self._seq), fn, args))

    def next_time(self) -> float:
        """When the next queued event fires (inf when none): a component may advance its own state
        inline up to this time without queueing events, since nothing can reach it before then."""
        return self._heap[0][0] if self._heap else float("inf")

    def advance(self, time: float) -> None:
        assert self.now <= time <= self.next_time() * (1 + 1e-12)
        self.now = min(time, self.next_time())  # a run of steps summed in closed form may round up

    def run(self) -> None:
        heap, pop = self._heap, heapq.heappop  # bound once: this loop runs once per event
        while heap:
            self.now, _, fn, args = pop(heap)
            fn(*args)
