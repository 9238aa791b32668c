"""`ngram`: prompt lookup (CopySpec-style) over the prompt and the output so far.

For the last n tokens (n from `max_ngram` down to `min_ngram`) find their most recent earlier occurrence
in the request's tokens and propose what followed it. Each request keeps an index n-gram -> end position
of its latest occurrence, extended with the tokens committed since the previous call, so a step costs
O(new tokens x n) instead of a scan of the whole context. Committed tokens never change (drafts never
enter `token_ids`), so the index never needs to forget.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.spec_decode.proposers import DraftState, Proposer, ProposerContext


@dataclass
class _Index:
    upto: int = 0  # n-grams ending before this position are indexed
    last_end: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> its latest end position


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, ctx: ProposerContext | None = None, min_ngram: int = 2, max_ngram: int = 4):
        assert 1 <= min_ngram <= max_ngram, (min_ngram, max_ngram)
        self.min_n, self.max_n = min_ngram, max_ngram
        self._index: dict[str, _Index] = {}

    def propose(self, state: DraftState) -> list[int]:
        ids, k = state.token_ids, state.max_draft
        if k <= 0 or len(ids) < self.min_n + 1:
            return []
        idx = self._index.setdefault(state.request_id, _Index())
        end = len(ids) - 1  # the current tail ends here; index only strictly earlier ends
        for e in range(max(idx.upto, self.min_n - 1), end):
            for n in range(self.min_n, min(self.max_n, e + 1) + 1):
                idx.last_end[tuple(ids[e - n + 1:e + 1])] = e
        idx.upto = max(idx.upto, end)
        for n in range(min(self.max_n, end + 1), self.min_n - 1, -1):
            e = idx.last_end.get(tuple(ids[end - n + 1:]))
            if e is not None:
                return list(ids[e + 1:e + 1 + k])
        return []

    def release(self, request_id: str) -> None:
        self._index.pop(request_id, None)
