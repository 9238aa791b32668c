"""Test proposers (fakes registered by name beside the real ones): `oracle` and `always_wrong`.

Both are given the reference continuation of each prompt (`futures`: prompt token ids -> output token
ids, e.g. from a non-speculative run) and look up where the request is. `oracle` proposes the next
reference tokens (every draft accepted under greedy); `always_wrong` proposes each of them plus one
(mod vocab), so every draft is rejected and every step rolls back.
"""
from __future__ import annotations

from engine.spec_decode.proposers import DraftState, Proposer, ProposerContext


class OracleProposer(Proposer):
    name = "oracle"
    shift = 0

    def __init__(self, ctx: ProposerContext, futures: dict | None = None):
        self.vocab = ctx.vocab_size
        self.futures = {tuple(p): list(o) for p, o in (futures or {}).items()}

    def propose(self, state: DraftState) -> list[int]:
        ref = self.futures.get(tuple(state.token_ids[:state.num_prompt]))
        if ref is None:
            return []
        done = len(state.token_ids) - state.num_prompt
        return [(t + self.shift) % self.vocab for t in ref[done:done + state.max_draft]]


class AlwaysWrongProposer(OracleProposer):
    name = "always_wrong"
    shift = 1
