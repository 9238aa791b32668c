"""Discrete-event simulation of Splitwise's machine pools: prompt machines, token machines and a mixed pool.

    simulate_mixed_pool(requests, prompt_setups, token_setups, link[, limits]) -> SimResult

Splitwise (ISCA'24, §IV-A; its simulator's MixedPoolScheduler) gives every machine a role. A request's
prompt goes to the prompt machine with the fewest prompt tokens to compute, its tokens to the token
machine with the least KV placed on it; the prompt's KV crosses the link whole after the prompt ends.
When every prompt machine has a queue past `prompt_queue_tokens`, a token machine joins the mixed pool
and takes prompts too; when every token machine's KV is placed, a prompt machine joins it and takes
tokens. A machine in the mixed pool goes back to its own pool once it holds nothing. With neither, a
request runs whole on the least loaded machine (prompt and tokens together, as in a baseline).
Every machine is an `ArtifactReplica` (baseline.py: whole prompts and decoding requests in one batch, under
its token budget), so a token machine given a prompt mixes it with its decodes exactly as a baseline would.
The scheduler's signals are its own bookkeeping, as in the artifact: prompt tokens placed and not yet
computed plus one per unfinished request; KV tokens placed (prompt + output on the token side, prompt + 1
on the prompt side) and not yet freed. Pure Python; used by bench/repro/splitwise/verify.py.
"""
from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from bench.repro.splitwise.baseline import ArtifactReplica, ArtifactSetup
from cluster.planner.inputs.workload import Request
from cluster.planner.sim.disagg import Link, RunState, results_of
from cluster.planner.sim.events import EventQueue
from cluster.planner.sim.metrics import SimResult


@dataclass(frozen=True)
class PoolLimits:
    prompt_queue_tokens: int = 8192  # a prompt machine with a queue past this takes no more prompts


class _Machine(ArtifactReplica):
    """A replica that also runs prompts whose tokens go elsewhere and tokens whose prompt ran elsewhere."""

    def __init__(self, setup: ArtifactSetup, ev: EventQueue, st: RunState, pools: "_Pools", home: str):
        super().__init__(setup, ev, st)
        self.pools, self.home, self.role = pools, home, home
        self.prompt_only: set[int] = set()  # prompts run here, tokens elsewhere
        self.decode_waiting: deque[int] = deque()  # KV arrived, not yet admitted
        self.in_step: set[int] = set()  # prompts in the running step
        self.sched_pending = 0  # the scheduler's: prompt tokens placed here + one per request's tokens
        self.sched_kv = 0  # the scheduler's: KV tokens placed here and not yet freed

    def _need(self, i: int) -> int:
        r = self.st.reqs[i]
        return r.input_len + 1 if i in self.prompt_only else r.input_len + r.output_len

    def queued(self) -> bool:
        """Work waiting to run (the artifact's pending queue: not in the running batch)."""
        return bool(self.waiting or self.decode_waiting or any(i not in self.in_step for i in self.prefilling))

    def idle(self) -> bool:
        return not (self.waiting or self.decode_waiting or self.prefilling or self.batch)

    def arrive_tokens(self, i: int) -> None:
        self.decode_waiting.append(i)
        if not self.stepping:
            self._step()

    def _admit(self) -> None:
        super()._admit()
        while self.decode_waiting and self.seqs < self.s.max_seqs:
            i = self.decode_waiting[0]
            need = self._need(i)
            if self.used + need > self.s.kv_tokens and self.seqs:
                break
            self.decode_waiting.popleft()
            r = self.st.reqs[i]
            self.used, self.seqs = self.used + need, self.seqs + 1
            self.outstanding += r.output_len
            self.batch += 1
            self.context += r.input_len + 1
            self.prompt_load += 1
            # its first token came from the prompt machine: output_len - 1 steps from this one on
            heapq.heappush(self.finishing, (self.step_no + r.output_len - 2, i))

    def _plan_chunks(self):
        chunks, tokens, sq = super()._plan_chunks()
        self.in_step = {i for i, _ in chunks}
        return chunks, tokens, sq

    def _step(self) -> None:
        super()._step()
        if not self.stepping:
            self.in_step = set()
            self.pools.freed(self)

    def _first_token(self, i: int, now: float) -> None:
        r = self.st.reqs[i]
        self.sched_pending -= r.input_len
        if i not in self.prompt_only:
            super()._first_token(i, now)
            return
        self.prompt_only.discard(i)
        self.used -= r.input_len + 1
        self.seqs -= 1
        self.outstanding -= 1  # (what `arrive` counted: its prompt, computed, and one token)
        self.prompt_load -= 1
        self.sched_kv -= r.input_len + 1
        if r.output_len <= 1:
            self.pools.finished(i, now)
        else:
            self.pools.ship(i, now)

    def _finish(self, i: int, now: float) -> None:
        r = self.st.reqs[i]
        super()._finish(i, now)
        self.sched_pending -= 1
        self.sched_kv -= r.input_len + r.output_len


class _Pools:
    def __init__(self, requests, prompt, token, link: Link, limits: PoolLimits):
        self.ev, self.st, self.link, self.limits = EventQueue(), RunState(requests), link, limits
        self.machines = [_Machine(s, self.ev, self.st, self, "prompt") for s in prompt] + \
                        [_Machine(s, self.ev, self.st, self, "token") for s in token]
        self.token_of: dict[int, _Machine] = {}

    def _in(self, role: str) -> list[_Machine]:
        return [m for m in self.machines if m.role == role]

    def _prompt_machine(self, group: list[_Machine], n: int) -> _Machine | None:
        if not group:
            return None
        m = min(group, key=lambda x: x.sched_pending)
        long = m.queued() and m.sched_pending + n > self.limits.prompt_queue_tokens
        return None if long else m

    def _token_machine(self, group: list[_Machine], need: int) -> _Machine | None:
        if not group:
            return None
        m = min(group, key=lambda x: x.sched_kv)
        return None if m.sched_kv + need >= m.s.kv_tokens else m

    def arrive(self, i: int) -> None:
        r = self.st.reqs[i]
        need = r.input_len + r.output_len
        n = r.input_len
        p = self._prompt_machine(self._in("prompt"), n) or self._prompt_machine(self._in("mixed"), n)
        t = self._token_machine(self._in("token"), need) or self._token_machine(self._in("mixed"), need)
        if p is None and self._in("token"):  # every prompt queue is long: a token machine helps
            p = min(self._in("token"), key=lambda x: x.sched_pending)
            p.role = "mixed"
        if t is None and self._in("prompt"):  # every token machine's KV is placed: a prompt machine helps
            t = min(self._in("prompt"), key=lambda x: x.sched_kv)
            t.role = "mixed"
        if p is None or t is None:  # nothing left to borrow: the whole request on the least loaded machine
            p = t = min(self.machines, key=lambda x: x.sched_pending)
        p.sched_pending += r.input_len
        t.sched_pending += 1
        if p is t:
            p.sched_kv += need
        else:
            p.sched_kv += r.input_len + 1
            t.sched_kv += need
            p.prompt_only.add(i)
            self.token_of[i] = t
        p.arrive(i)

    def ship(self, i: int, now: float) -> None:
        """The prompt's KV crosses the link whole, then its tokens start on their machine."""
        xfer = self.st.reqs[i].input_len * self.link.kv_bytes_per_token / self.link.bandwidth
        self.ev.at(now + xfer, self.token_of.pop(i).arrive_tokens, i)

    def finished(self, i: int, now: float) -> None:
        """One output token only: done at the prompt machine; its token machine's placement is undone."""
        t = self.token_of.pop(i)
        r = self.st.reqs[i]
        self.st.done[i] = now
        t.sched_pending -= 1
        t.sched_kv -= r.input_len + r.output_len

    def freed(self, m: _Machine) -> None:
        if m.role == "mixed" and m.idle():
            m.role = m.home


def simulate_mixed_pool(requests: list[Request], prompt: list[ArtifactSetup], token: list[ArtifactSetup], link: Link,
                        limits: PoolLimits = PoolLimits()) -> SimResult:
    assert prompt and token and requests
    sim = _Pools(requests, prompt, token, link, limits)
    late = prompt[0].model.admission_s
    for i, r in enumerate(requests):
        sim.ev.at(r.arrival + late, sim.arrive, i)
    sim.ev.run()
    return results_of(sim.st)
