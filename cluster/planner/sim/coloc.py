"""Discrete-event simulation of the colocated mode: each replica is one engine doing both phases.

A replica's step (vLLM/Sarathi chunked prefill, like `engine.LLM`'s scheduler): every running decode
sequence brings one token; the rest of the token budget goes to prompt chunks, FCFS over admitted
requests. A request is admitted (FIFO) when its reserved KV (prompt + output) fits the replica's capacity
and the sequence cap. Step time = `model.mixed(chunk tokens, chunk SQ, B, C)`; a prompt whose last chunk
ran gets its first token at the end of that step (TTFT) and decodes from the next step on.
Requests go to the replica with the fewest outstanding tokens at arrival (`Replica.load`). Replicas on
one node's memory bus (`Sharing`, `bus.py`) slow each other: a step's prompt-chunk part is scaled by the
prefill co-run factor and its decode part by the decode factor, both read at the step's start.
A setup builds its replica (`ColocSetup.replica`): the Splitwise reproduction's baselines batch and route
their own way by subclassing both (bench/repro/splitwise/baseline.py), and its mixed pools subclass
`Replica`. Pure Python; called by `search` and `report` on equal terms with `disagg`, and by `elastic`.
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
from cluster.planner.sim.disagg import RunState, results_of, scaled_lines
from cluster.planner.sim.events import EventQueue
from cluster.planner.sim.metrics import SimResult


@dataclass(frozen=True)
class ColocSetup:
    model: LatencyModel
    kv_tokens: int
    token_budget: int = 2048  # tokens per step: decode tokens first, prompt chunks fill the rest
    max_seqs: int = 256

    def replica(self, ev: EventQueue, st: RunState, bus: tuple[Bus, int] = (ALONE, 0)) -> "Replica":
        """The simulated engine this setup describes."""
        return Replica(self, ev, st, bus)


class Replica:
    def __init__(self, setup: ColocSetup, ev: EventQueue, st: RunState, bus: tuple[Bus, int] = (ALONE, 0)):
        self.s, self.ev, self.st = setup, ev, st
        self.bus, self.me = bus
        self.waiting: deque[int] = deque()
        self.prefilling: deque[int] = deque()  # admitted, prompt not finished
        self.done_tokens: dict[int, int] = {}  # prompt tokens already computed
        self.used = self.seqs = 0
        self.batch = self.context = 0  # decoding sequences and their summed context
        self.step_no = 0
        self.finishing: list[tuple[int, int]] = []
        self.stepping = False
        self.outstanding = 0  # prompt + output tokens not yet done: the router's load signal

    def _need(self, i: int) -> int:
        return self.st.reqs[i].input_len + self.st.reqs[i].output_len

    def load(self) -> int:
        return self.outstanding

    def arrive(self, i: int) -> None:
        self.waiting.append(i)
        self.outstanding += self._need(i)
        if not self.stepping:
            self._step()

    def _admit(self) -> None:
        while self.waiting and self.seqs < self.s.max_seqs:
            need = self._need(self.waiting[0])
            if self.used + need > self.s.kv_tokens and self.seqs:
                break
            i = self.waiting.popleft()
            self.used, self.seqs = self.used + need, self.seqs + 1
            self.prefilling.append(i)
            self.done_tokens[i] = 0

    def _plan_chunks(self) -> tuple[list[tuple[int, int]], int, float]:
        """Prompt chunks for this step: (request, chunk) pairs, their tokens and attention SQ term."""
        budget = self.s.token_budget - self.batch
        chunks, tokens, sq = [], 0, 0.0
        for i in self.prefilling:
            if budget <= 0:
                break
            p = self.done_tokens[i]
            c = min(self.st.reqs[i].input_len - p, budget)
            chunks.append((i, c))
            tokens, sq, budget = tokens + c, sq + c * (2 * p + c), budget - c
        return chunks, tokens, sq

    def _step(self) -> None:
        """Steps back to back; decode-only stretches that end before the next event are summed in
        closed form (`stepping`), steps with prompt chunks run one event each."""
        while True:
            self._admit()
            if not self.batch and not self.prefilling:
                self.stepping = False
                self.bus.set(self.me, None)
                return
            self.stepping = True
            if self.prefilling:
                chunks, tokens, sq = self._plan_chunks()
                self.ev.at(self.ev.now + self._mixed_time(tokens, sq), self._step_done, chunks)
                return
            self.bus.set(self.me, "decode")
            f = self.bus.factor(self.me, "decode") * drift_factor(self.s.model, "decode", self.ev.now)
            run = StepRun(scaled_lines(self.s.model.decode_lines(self.batch), f), self.context, self.batch)
            horizon = min(self.ev.next_time(), drift_horizon(self.s.model, "decode", self.ev.now))
            k = run.steps_before(horizon - self.ev.now, self.finishing[0][0] - self.step_no + 1)
            if k == 0:
                self.ev.at(self.ev.now + run.step_time(0), self._step_done, [])
                return
            self.ev.advance(self.ev.now + run.run_time(k))
            self.context += (k - 1) * self.batch
            self.step_no += k - 1
            self._finish_step([])

    def _mixed_time(self, tokens: int, sq: float) -> float:
        """A step carrying prompt chunks: the chunks cost their prefill time, the decode tokens riding
        along the rest (`LatencyModel.mixed`); each part is slowed by its own co-run factor, and the
        larger part is what this replica looks like to its neighbours."""
        model, bus = self.s.model, self.bus
        total = model.mixed(tokens, sq, self.batch, self.context)
        if bus is ALONE and model.drift is None:  # no neighbours (set does nothing), no drift: factors 1
            return total
        pre = model.mixed(tokens, sq, 0, 0)
        bus.set(self.me, "prefill" if pre >= total - pre else "decode")
        fp, fd = bus.factor(self.me, "prefill"), bus.factor(self.me, "decode")
        fp *= drift_factor(model, "prefill", self.ev.now)
        fd *= drift_factor(model, "decode", self.ev.now)
        if fp == fd == 1.0:
            return total
        return pre * fp + (total - pre) * fd

    def _step_done(self, chunks: list[tuple[int, int]]) -> None:
        self._finish_step(chunks)
        self._step()

    def _finish_step(self, chunks: list[tuple[int, int]]) -> None:
        now, st = self.ev.now, self.st
        self.context += self.batch
        while self.finishing and self.finishing[0][0] <= self.step_no:
            _, i = heapq.heappop(self.finishing)
            self._finish(i, now)
            self.batch -= 1
            self.context -= st.reqs[i].input_len + st.reqs[i].output_len
        for i, c in chunks:
            self.done_tokens[i] += c
            self.outstanding -= c
            r = st.reqs[i]
            if self.done_tokens[i] < r.input_len:
                continue
            self.prefilling.remove(i)
            del self.done_tokens[i]
            st.first[i] = now
            self._first_token(i, now)
        self.step_no += 1

    def _first_token(self, i: int, now: float) -> None:
        """`i`'s prompt ended in the step numbered `step_no`: it decodes here from the next step on."""
        r = self.st.reqs[i]
        if r.output_len <= 1:
            self._finish(i, now)
        else:  # decodes in steps step_no+1 .. step_no+output_len-1
            self.batch += 1
            self.context += r.input_len + 1
            heapq.heappush(self.finishing, (self.step_no + r.output_len - 1, i))

    def _finish(self, i: int, now: float) -> None:
        self.st.done[i] = now
        self.used -= self._need(i)
        self.seqs -= 1
        self.outstanding -= self.st.reqs[i].output_len


def simulate_colocated(requests: list[Request], replicas: list[ColocSetup], sharing: Sharing | None = None) -> SimResult:
    """`sharing`: the node of each replica; None: no co-run slowdown."""
    assert replicas and requests
    ev, st = EventQueue(), RunState(requests)
    buses = sharing.buses(len(replicas)) if sharing is not None else [(ALONE, k) for k in range(len(replicas))]
    reps = [s.replica(ev, st, b) for s, b in zip(replicas, buses)]

    def arrive(i: int) -> None:
        # one replica (every per-instance goodput probe): itself, without the key calls
        (reps[0] if len(reps) == 1 else min(reps, key=lambda r: r.load())).arrive(i)

    late = replicas[0].model.admission_s  # the runtime's routing before a replica sees it
    for i, r in enumerate(requests):
        ev.at(r.arrival + late, arrive, i)
    ev.run()
    return results_of(st)
