"""`recycling`: Token Recycling (Luo et al., 2024): drafts from the target's own earlier candidates.

An adjacency matrix `M [vocab, top]` (int32, < 2 MB: 49,152 x 8 x 4 bytes = 1.5 MB for SmolLM2) holds,
for every token, the target's top candidates for the next token the last time that token was an input
with logits (every verify row and every sampled row: `observe`). Drafting follows the best path: from the
last token take its first candidate, then that token's first candidate, ... up to k tokens or an unknown
token. The matrix is shared by all requests (tokens recycle across requests), so `release` has nothing
to drop.
"""
from __future__ import annotations

import torch

from engine.spec_decode.proposers import DraftState, Proposer, ProposerContext

MAX_BYTES = 2 * 1024 * 1024


class RecyclingProposer(Proposer):
    name = "recycling"

    def __init__(self, ctx: ProposerContext, top: int = 8):
        self.top = max(1, min(top, MAX_BYTES // (4 * ctx.vocab_size), ctx.vocab_size))
        self.matrix = torch.full((ctx.vocab_size, self.top), -1, dtype=torch.int32)  # [vocab, top]
        assert self.nbytes < MAX_BYTES

    @property
    def nbytes(self) -> int:
        return self.matrix.numel() * self.matrix.element_size()

    def observe(self, input_ids: list[int], logits: torch.Tensor) -> None:
        """logits [n, vocab] after each input token: remember each input's top candidates."""
        if not input_ids:
            return
        top = torch.topk(logits, self.top, dim=-1).indices.to(device="cpu", dtype=torch.int32)  # [n, top]
        self.matrix[torch.tensor(input_ids, dtype=torch.long)] = top

    def propose(self, state: DraftState) -> list[int]:
        draft: list[int] = []
        t = state.token_ids[-1]
        first = self.matrix[:, 0]
        while len(draft) < state.max_draft:
            t = int(first[t])
            if t < 0:
                break
            draft.append(t)
        return draft
