"""Discrete-event simulation of a colocated pool whose size changes while it serves (the autoscaler's bench).

Replicas are `coloc`'s (the same step model, chunked prefill, KV admission); what is new is the pool:

    simulate_elastic(requests, setup, control, interval_s, start_delay_s, initial)
      every `interval_s`: control(now, view) -> the pool's target size, `view` what a live autoscaler
        could know at `now`: the arrivals so far and the requests finished so far (`ElasticView`)
      grow: a new replica is paid for from the decision on and takes arrivals `start_delay_s` later
        (a real replica loads weights and warms up first);
      shrink: the newest serving replica drains -- it takes no new arrival, finishes what it holds (its
        queue too: nothing fails because of a resize) and is released (no longer paid for) once empty;
      an arrival goes to the serving replica with the fewest outstanding tokens.
    -> ElasticResult: per-request results (as `SimResult`), the replica count over time, replica-seconds
       paid, and every scale event (time, from, to) -- a bench reads SLO misses inside transitions from it.
Pure Python; not used by the search.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from cluster.planner.inputs.workload import Request
from cluster.planner.sim.bus import ALONE
from cluster.planner.sim.coloc import ColocSetup, Replica
from cluster.planner.sim.disagg import RunState, results_of
from cluster.planner.sim.events import EventQueue
from cluster.planner.sim.metrics import SimResult


@dataclass
class ElasticView:
    """What the controller sees at `now` (indices into `requests`, in arrival order / finish order)."""
    now: float
    requests: list[Request]
    arrived: int  # requests[:arrived] have arrived
    finished: list[int]  # indices of requests finished by now, in finish order
    first: list[float]  # first-token time per request (valid for finished ones)
    done: list[float]  # finish time per request (valid for finished ones)
    serving: int  # replicas taking arrivals now
    target: int  # the pool's size (serving + starting)
    draining: int = 0  # replicas leaving, still finishing what they hold


@dataclass
class ElasticResult:
    result: SimResult
    timeline: list[tuple[float, int, int]] = field(default_factory=list)  # (time, target, serving)
    events: list[tuple[float, int, int]] = field(default_factory=list)  # (time, from, to) of each resize
    replica_seconds: float = 0.0  # paid: from each replica's decision to its release


class _Pool:
    def __init__(self, setup: ColocSetup, ev: EventQueue, st: RunState, start_delay_s: float):
        self.setup, self.ev, self.st, self.delay = setup, ev, st, start_delay_s
        self.serving: list[Replica] = []
        self.starting = 0
        self.cancelled = 0  # starting replicas given up before they served (their start events still fire)
        self.draining: list[tuple[Replica, float]] = []  # (replica, paid since)
        self.paid_since: dict[int, float] = {}  # id(replica) -> decision time
        self.paid = 0.0
        self.finished: list[int] = []

    @property
    def target(self) -> int:
        return len(self.serving) + self.starting - self.cancelled

    def grow(self, now: float) -> None:
        if self.cancelled:  # one given up while starting: take it back
            self.cancelled -= 1
            return
        self.starting += 1
        self.ev.at(now + self.delay, self.ready, now)

    def ready(self, since: float) -> None:
        self.starting -= 1
        if self.cancelled:
            self.cancelled -= 1
            self.paid += self.ev.now - since  # paid while it was starting
            return
        r = self.setup.replica(self.ev, self.st, (ALONE, 0))
        finish = r._finish

        def finished(i: int, now: float) -> None:  # the controller's view of finished requests
            finish(i, now)
            self.finished.append(i)
        r._finish = finished
        self.paid_since[id(r)] = since
        self.serving.append(r)

    def shrink(self, now: float) -> None:
        if self.starting > self.cancelled:  # a replica not serving yet is the cheapest to give up
            self.cancelled += 1
            return
        r = self.serving.pop()
        self.draining.append((r, self.paid_since.pop(id(r))))

    def release_idle(self, now: float) -> None:
        keep = []
        for r, since in self.draining:
            if r.outstanding <= 0 and not r.stepping and not r.waiting:
                self.paid += now - since
            else:
                keep.append((r, since))
        self.draining = keep

    def arrive(self, i: int) -> None:
        min(self.serving, key=lambda r: r.outstanding).arrive(i)


def simulate_elastic(requests: list[Request], setup: ColocSetup, control: Callable[[float, ElasticView], int],
                     interval_s: float, start_delay_s: float, initial: int) -> ElasticResult:
    assert requests and initial >= 1
    ev, st = EventQueue(), RunState(requests)
    pool = _Pool(setup, ev, st, start_delay_s)
    for _ in range(initial):
        pool.starting += 1
        pool.ready(0.0)
    out = ElasticResult(SimResult((), 0.0))
    arrived = [0]

    def arrive(i: int) -> None:
        arrived[0] = i + 1
        pool.arrive(i)

    def tick() -> None:
        now = ev.now
        pool.release_idle(now)
        view = ElasticView(now, requests, arrived[0], pool.finished, st.first, st.done, len(pool.serving),
                           pool.target, len(pool.draining))
        target = max(1, control(now, view))
        before = pool.target
        while pool.target < target:
            pool.grow(now)
        while pool.target > target:
            pool.shrink(now)
        if target != before:
            out.events.append((now, before, target))
        out.timeline.append((now, pool.target, len(pool.serving)))
        if arrived[0] < len(requests) or pool.draining:
            ev.at(now + interval_s, tick)

    late = setup.model.admission_s
    for i, r in enumerate(requests):
        ev.at(r.arrival + late, arrive, i)
    ev.at(interval_s, tick)
    ev.run()
    end = max(st.done)
    pool.release_idle(end)
    pool.paid += sum(end - pool.paid_since[id(r)] for r in pool.serving)
    pool.paid += sum(end - since for _, since in pool.draining)
    out.result, out.replica_seconds = results_of(st), pool.paid
    return out
