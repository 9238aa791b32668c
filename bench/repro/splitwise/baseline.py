"""Splitwise's machines as its artifact runs them: whole-prompt batching and the token_jsq router's signal.

    ArtifactSetup(model, kv_tokens, token_budget, max_seqs, whole_prompts, route)   a `ColocSetup` whose
                  replica is an `ArtifactReplica` (the fields of the old ColocSetup knobs, same order)
    ArtifactReplica  pdserve's colocated replica (cluster/planner/sim/coloc.py) with two differences:
      whole_prompts  ORCA-style mixed batching (Splitwise's baselines): whole prompts FCFS while their tokens
                     fit the budget, the first one always (a longer prompt runs alone), decodes riding along,
                     instead of chunked prefill;
      route          the router's signal: "outstanding" (prompt + output tokens not yet done, pdserve's
                     router) or "prompts" (prompt tokens not yet computed plus one per unfinished request,
                     splitwise-sim's token_jsq).

`simulate_colocated` and the planner's goodput bisection take an `ArtifactSetup` as any `ColocSetup`;
`mixed_pool._Machine` builds on `ArtifactReplica`. Pure Python; used by phase.py, verify.py, mixed_pool.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from cluster.planner.sim.bus import ALONE, Bus
from cluster.planner.sim.coloc import ColocSetup, Replica
from cluster.planner.sim.disagg import RunState
from cluster.planner.sim.events import EventQueue


@dataclass(frozen=True)
class ArtifactSetup(ColocSetup):
    whole_prompts: bool = False
    route: str = "outstanding"  # or "prompts"

    def replica(self, ev: EventQueue, st: RunState, bus: tuple[Bus, int] = (ALONE, 0)) -> "ArtifactReplica":
        return ArtifactReplica(self, ev, st, bus)


class ArtifactReplica(Replica):
    s: ArtifactSetup

    def __init__(self, setup: ArtifactSetup, ev: EventQueue, st: RunState, bus: tuple[Bus, int] = (ALONE, 0)):
        super().__init__(setup, ev, st, bus)
        self.prompt_load = 0  # prompt tokens not yet computed + unfinished requests (route "prompts")

    def load(self) -> int:
        return self.prompt_load if self.s.route == "prompts" else self.outstanding

    def arrive(self, i: int) -> None:
        self.prompt_load += self.st.reqs[i].input_len + 1  # (before the step it may start)
        super().arrive(i)

    def _plan_chunks(self) -> tuple[list[tuple[int, int]], int, float]:
        if not self.s.whole_prompts:
            return super()._plan_chunks()
        chunks, tokens, sq = [], 0, 0.0
        for i in self.prefilling:
            n = self.st.reqs[i].input_len
            if chunks and tokens + n > self.s.token_budget:
                break
            chunks.append((i, n))
            tokens, sq = tokens + n, sq + n * n
        return chunks, tokens, sq

    def _finish_step(self, chunks: list[tuple[int, int]]) -> None:
        self.prompt_load -= sum(c for _, c in chunks)  # (nothing reads the load mid-step)
        super()._finish_step(chunks)

    def _finish(self, i: int, now: float) -> None:
        super()._finish(i, now)
        self.prompt_load -= 1
