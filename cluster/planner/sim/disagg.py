"""Discrete-event simulation of the disaggregated mode: prefill pool -> KV transfer -> decode pool.

Life of a request (mirrors docs/design.md's "Life of a request"):
  1. arrives; the router queues it on the prefill instance with the fewest prompt tokens submitted and not
     yet done (queued or in a running batch: the real router's `queued_tokens`, cluster/serving);
  2. the instance forms FCFS batches under a token budget (and a sequence cap; a prompt longer than the
     budget runs alone) and returns the first token after `model.prefill(T, SQ)` (TTFT ends); with PP it
     takes the next batch after one stage (`prefill_interval`);
  3. KV moves layer by layer while later layers compute: only what cannot hide behind the batch's
     compute is added, and at least the last layer's share: tail = max(xfer / layers, xfer - latency);
  4. the request joins the decode instance with the most free KV tokens; decode admits FIFO while the
     reserved KV (prompt + output) fits the instance's capacity and the batch cap, and runs continuous
     batching: each step of B sequences with context C takes `model.decode(B, C)`.
Instances never share a link model: transfers do not contend (the planner's bandwidths are per device).
Instances on one node's memory bus (`Sharing`, from `bus.py`) slow each other's steps by the profile's
measured co-run factors: a prefill batch or a run of decode steps is scaled by `Bus.factor` at its start.
Who calls: `search` (per-phase goodput and the whole-plan check) and `report`. Pure Python.
"""
from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from cluster.planner.inputs.workload import Request
from cluster.planner.latency.base import LatencyModel
from cluster.planner.latency.drift import drift_factor, drift_horizon
from cluster.planner.latency.stepping import StepRun
from cluster.planner.sim.bus import ALONE, Bus, Sharing
from cluster.planner.sim.events import EventQueue
from cluster.planner.sim.metrics import RequestResult, SimResult


@dataclass(frozen=True)
class PrefillSetup:
    model: LatencyModel
    token_budget: int = 8192
    max_seqs: int = 256


@dataclass(frozen=True)
class DecodeSetup:
    model: LatencyModel
    kv_tokens: int  # KV capacity of the instance, in tokens
    max_seqs: int = 256


@dataclass(frozen=True)
class Link:
    kv_bytes_per_token: float  # whole model (all TP ranks ship their shards in parallel)
    bandwidth: float  # bytes/s between a prefill and a decode instance (aggregate over TP ranks)
    layers: int
    reshard_s_per_token: float = 0.0  # re-layout on the decode side when TP differs (`kv_link.reshard_cost`)


class RunState:
    """Mutable bookkeeping of one run (times per request index)."""

    def __init__(self, requests: list[Request]):
        self.reqs = requests
        n = len(requests)
        self.first = [0.0] * n
        self.done = [0.0] * n


def scaled_lines(lines, f: float):
    return tuple((a * f, b * f) for a, b in lines) if f != 1.0 else lines


class _Prefill:
    def __init__(self, setup: PrefillSetup, sim: "_Disagg", bus: tuple[Bus, int] = (ALONE, 0)):
        self.s, self.sim = setup, sim
        self.bus, self.me = bus
        self.inflight = 0  # batches started and not done (PP keeps several in flight)
        self.queue: deque[int] = deque()
        self.pending_tokens = 0  # queued or in a running batch: the router's load signal
        self.free_at = 0.0  # first stage free
        self.scheduled = False

    def enqueue(self, i: int) -> None:
        self.queue.append(i)
        self.pending_tokens += self.sim.st.reqs[i].input_len
        self._kick()

    def _kick(self) -> None:
        if not self.scheduled and self.queue:
            self.scheduled = True
            self.sim.ev.at(max(self.sim.ev.now, self.free_at), self.start)

    def start(self) -> None:
        self.scheduled = False
        reqs, batch, tokens, sq = self.sim.st.reqs, [], 0, 0.0
        while self.queue and len(batch) < self.s.max_seqs:
            n = reqs[self.queue[0]].input_len
            if batch and tokens + n > self.s.token_budget:
                break
            batch.append(self.queue.popleft())
            tokens, sq = tokens + n, sq + n * n
        now = self.sim.ev.now
        f = self.bus.factor(self.me, "prefill")  # neighbours mid-step on this node's memory bus
        f *= drift_factor(self.s.model, "prefill", now)
        latency = self.s.model.prefill(tokens, sq) * f
        self.free_at = now + self.s.model.prefill_interval(tokens, sq) * f
        self.inflight += 1
        self.bus.set(self.me, "prefill")
        self.sim.ev.at(now + latency, self.done, batch, tokens, latency)
        self._kick()

    def done(self, batch: list[int], tokens: int, latency: float) -> None:
        self.inflight -= 1
        self.pending_tokens -= tokens
        if not self.inflight:
            self.bus.set(self.me, None)
        self.sim.prefill_done(batch, tokens, latency)


class _Decode:
    def __init__(self, setup: DecodeSetup, sim: "_Disagg", bus: tuple[Bus, int] = (ALONE, 0)):
        self.s, self.sim = setup, sim
        self.bus, self.me = bus
        self.waiting: deque[int] = deque()
        self.used = 0  # reserved KV tokens
        self.waiting_need = 0  # KV tokens the waiting requests will reserve
        self.batch = 0
        self.context = 0  # sum of context lengths of running sequences
        self.step_no = 0
        self.finishing: list[tuple[int, int]] = []  # heap of (step number it finishes in, request)
        self.stepping = False

    def free(self) -> int:
        return self.s.kv_tokens - self.used - self.waiting_need

    def _need(self, i: int) -> int:
        r = self.sim.st.reqs[i]
        return r.input_len + r.output_len

    def arrive(self, i: int) -> None:
        self.waiting.append(i)
        self.waiting_need += self._need(i)
        if not self.stepping:
            self._step()

    def _admit(self) -> None:
        while self.waiting and self.batch < self.s.max_seqs:
            i = self.waiting[0]
            need = self._need(i)
            if self.used + need > self.s.kv_tokens and self.batch:  # alone: admitted (would preempt)
                break
            self.waiting.popleft()
            self.waiting_need -= need
            self.used += need
            self.batch += 1
            self.context += self.sim.st.reqs[i].input_len + 1
            # the first token came from prefill: output_len - 1 more steps, the last in step_no + that - 1
            heapq.heappush(self.finishing, (self.step_no + self.sim.st.reqs[i].output_len - 2, i))

    def _step(self) -> None:
        """Run steps back to back. Steps that all end before the next queued event (and no later than
        the next finish) are summed in closed form (`stepping`); the first that does not is queued."""
        ev, model = self.sim.ev, self.s.model
        while True:
            self._admit()
            if not self.batch:
                self.stepping = False
                self.bus.set(self.me, None)
                return
            self.stepping = True
            self.bus.set(self.me, "decode")
            f = self.bus.factor(self.me, "decode") * drift_factor(model, "decode", ev.now)
            run = StepRun(scaled_lines(model.decode_lines(self.batch), f), self.context, self.batch)
            horizon = min(ev.next_time(), drift_horizon(model, "decode", ev.now))
            k = run.steps_before(horizon - ev.now, self.finishing[0][0] - self.step_no + 1)
            if k == 0:
                ev.at(ev.now + run.step_time(0), self._step_done)
                return
            ev.advance(ev.now + run.run_time(k))
            self.context += (k - 1) * self.batch
            self.step_no += k - 1
            self._finish_step()

    def _step_done(self) -> None:
        self._finish_step()
        self._step()

    def _finish_step(self) -> None:
        now, st = self.sim.ev.now, self.sim.st
        self.context += self.batch
        while self.finishing and self.finishing[0][0] <= self.step_no:
            _, i = heapq.heappop(self.finishing)
            st.done[i] = now
            self.used -= self._need(i)
            self.batch -= 1
            self.context -= st.reqs[i].input_len + st.reqs[i].output_len  # its context after this step
        self.step_no += 1


class _Disagg:
    def __init__(self, requests, prefill, decode, link, sharing: Sharing | None = None):
        self.ev, self.st, self.link = EventQueue(), RunState(requests), link
        n = len(prefill) + len(decode)
        buses = sharing.buses(n) if sharing is not None else [(ALONE, k) for k in range(n)]
        self.prefill = [_Prefill(s, self, b) for s, b in zip(prefill, buses)]
        self.decode = [_Decode(s, self, b) for s, b in zip(decode, buses[len(prefill):])]

    def arrive(self, i: int) -> None:
        # one instance (every per-instance goodput probe): itself, without the key calls
        pool = self.prefill
        (pool[0] if len(pool) == 1 else min(pool, key=lambda p: p.pending_tokens)).enqueue(i)

    def prefill_done(self, batch: list[int], tokens: int, latency: float) -> None:
        now = self.ev.now
        xfer = tokens * self.link.kv_bytes_per_token / self.link.bandwidth
        tail = max(xfer / self.link.layers, xfer - latency)
        for i in batch:
            self.st.first[i] = now
            if self.st.reqs[i].output_len <= 1:
                self.st.done[i] = now
            else:
                reshard = self.st.reqs[i].input_len * self.link.reshard_s_per_token
                self.ev.at(now + tail + reshard, self.to_decode, i)

    def to_decode(self, i: int) -> None:
        pool = self.decode
        (pool[0] if len(pool) == 1 else max(pool, key=lambda d: d.free())).arrive(i)


def simulate_disaggregated(requests: list[Request], prefill: list[PrefillSetup], decode: list[DecodeSetup],
                           link: Link, sharing: Sharing | None = None) -> SimResult:
    """`sharing`: the node of each instance (prefill instances first); None: no co-run slowdown."""
    assert prefill and decode and requests
    sim = _Disagg(requests, prefill, decode, link, sharing)
    late = prefill[0].model.admission_s  # the runtime's routing before a prefill instance sees it
    for i, r in enumerate(requests):
        sim.ev.at(r.arrival + late, sim.arrive, i)
    sim.ev.run()
    return results_of(sim.st)


def simulate_decode_only(requests: list[Request], decode: list[DecodeSetup],
                         sharing: Sharing | None = None) -> SimResult:
    """The decode pool alone: each request's KV is there at its arrival (its first token too)."""
    assert decode and requests
    sim = _Disagg(requests, [], decode, Link(1.0, float("inf"), 1), sharing)
    for i, r in enumerate(requests):
        sim.st.first[i] = r.arrival
        if r.output_len <= 1:
            sim.st.done[i] = r.arrival
        else:
            sim.ev.at(r.arrival, sim.to_decode, i)
    sim.ev.run()
    return results_of(sim.st)


def results_of(st: RunState) -> SimResult:
    out, new = [], tuple.__new__  # the NamedTuple's own __new__ does just this, one call deeper
    for i, r in enumerate(st.reqs):
        ttft = st.first[i] - r.arrival
        tpot = (st.done[i] - st.first[i]) / (r.output_len - 1) if r.output_len > 1 else 0.0
        out.append(new(RequestResult, (r.arrival, ttft, tpot, st.done[i] - r.arrival, r.input_len, r.output_len)))
    return SimResult(tuple(out), max(st.done))
