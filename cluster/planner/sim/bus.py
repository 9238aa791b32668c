"""A node's shared memory bus: the co-run slowdown of instances whose steps overlap on one node.

Instances placed on one node of shared-memory hardware (`cpu-local`: worker processes on the cores of
one DRAM bus and one last-level cache) slow each other while both are mid-step. `pdserve profile`
measures the factors (`calibrate/corun.py`, the profile's `corun` entry): slowdown[(my kind, neighbour kind)]
for kinds `prefill` and `decode`. GPU hardware keeps factor 1 (each device has its own HBM) unless its
profile carries a `corun` entry.

    Corun                       the measured factors (`latency/interference.py`; `Corun.none()`: none)
    Sharing(corun, nodes)       which node each simulated instance sits on; `buses()` hands each its Bus
    Bus.factor(me, kind)        the slowdown of a step of `kind` that `me` starts now
    Bus.set(me, kind | None)    `me` starts a step of `kind` / goes idle

How the simulators use it (`disagg`, `coloc`): when a step (or a closed-form run of decode steps,
which the simulators cut at the next event, i.e. before any neighbour can change state) starts, its time
is scaled by `factor`; a colocated step that carries a prompt chunk scales its prefill part by the
prefill factor and its decode part by the decode factor. The factor is fixed at the step's start: a
neighbour starting or stopping mid-step changes only later steps (one step is short next to a request).
Several busy neighbours add their excess, 1 + sum(f - 1): bandwidth shares add up to first order.
Who builds it: `search/pool_placement.simulate_plan` (whole plans: the search's check and the report) and
`bench/checks/planner_check.py`. Per-instance goodputs (`goodput`) stay those of a lone instance: an upper bound
that the whole-plan check corrects (a node full of instances behind one router also pools their bursts,
which a "node filled with one kind" measure would mix into the interference). Pure Python.
"""
from __future__ import annotations

from dataclasses import dataclass

from cluster.planner.latency.interference import Corun


class Bus:
    """The instances of one node: who is mid-step, and of what kind."""

    def __init__(self, corun: Corun):
        self.corun = corun
        self.busy: dict[int, str] = {}

    def set(self, me: int, kind: str | None) -> None:
        if kind is None:
            self.busy.pop(me, None)
        else:
            self.busy[me] = kind

    def factor(self, me: int, kind: str) -> float:
        return 1.0 + sum(self.corun.factor(kind, other) - 1.0 for m, other in self.busy.items() if m != me)


class _Alone(Bus):
    """An instance with no neighbours (no sharing given): factor 1, nothing to track."""

    def __init__(self):
        super().__init__(Corun.none())

    def set(self, me: int, kind: str | None) -> None:
        pass

    def factor(self, me: int, kind: str) -> float:
        return 1.0


ALONE = _Alone()


@dataclass(frozen=True)
class Sharing:
    """Node index of each simulated instance, in the simulator's order (prefill instances, then decode
    instances; or the colocated replicas); instances on one node share one `Bus`."""
    corun: Corun
    nodes: tuple[int, ...]

    def buses(self, count: int) -> list[tuple[Bus, int]]:
        """(bus, member id) for each of `count` instances."""
        assert len(self.nodes) == count, f"{len(self.nodes)} node slots for {count} instances"
        if self.corun.is_none:
            return [(ALONE, k) for k in range(count)]
        by_node: dict[int, Bus] = {}
        return [(by_node.setdefault(n, Bus(self.corun)), k) for k, n in enumerate(self.nodes)]


def pack_nodes(sizes: list[int], nodes: int, per_node: int) -> tuple[int, ...] | None:
    """First-fit decreasing of instance sizes (devices each) into nodes, as `pool_placement._packs` checks;
    the node of each instance in the given order (None: they do not fit)."""
    free = [per_node] * nodes
    out = [0] * len(sizes)
    for k in sorted(range(len(sizes)), key=lambda j: -sizes[j]):
        slot = next((n for n, f in enumerate(free) if f >= sizes[k]), None)
        if slot is None:
            return None
        free[slot] -= sizes[k]
        out[k] = slot
    return tuple(out)
