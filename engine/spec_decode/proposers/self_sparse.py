"""`self_sparse`: the target model drafts for itself, reading a sparse view of the request's own KV
(TriForce / MagicDec self-speculation, with Quest page selection as the sparse view).

Why it pays: long-context decode is bound by reading KV. A draft forward reads the sink pages, the recent
window and the best pages within `budget` tokens per row (engine/kv_cache/sparse.py), a fraction of an 8k
context; the verify forward reads the whole context once for all k + 1 positions. At short context the
sparse view is the whole context, a draft costs a plain step and the load-aware gate (policy.py, fed the
measured draft cost) turns drafting off.

Built once per engine by `make_proposer` with `ProposerContext.target` (the target's runner, KV backend,
block tables and allocator). At build it makes the backend keep page summaries (even while the engine's own
`sparse_attention` is off: verify and plain steps stay full) and turns dense decode copies off (a sparse
draft writes slots that the copies would chain across). Each `propose_batch`, for the drafting requests only:
  1. the scheduler already gave each request the slot of its last token (slot n, position p);
  2. k one-token forwards of the target, batched over the requests, with `backend.sparse` set to this
     proposer's config for their duration only: forward j feeds the previous draft (the last token for
     j = 0) at position p + j into slot n + j, appended to the request's block table while pages are free
     (never preempts: a request whose next page is not free stops drafting); its logits give draft j
     (greedy: argmax; sampling: the request's own keyed noise, as draft_model couples its drafts);
  3. every table is truncated back to n + 1 slots (pages the drafts took are freed; the kept page's summary
     is recomputed by the truncate hook).
The draft KV left in slots n .. n + k - 1 is never read as committed: the verify forward (or the plain
step, if the gate drops the drafts) rewrites slot n and the verified slots with full attention before any
query reads them, and rolls back the rejected ones (`BlockTables.truncate`), so the tokens are exactly
plain decoding's. Stateless between steps: `release` has nothing to drop.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.batch import SeqStep, StepBatch
from engine.errors import InvalidRequestError
from engine.kv_cache.sparse import SparseAttentionConfig
from engine.spec_decode.proposers import DraftState, Proposer, ProposerContext
from engine.spec_decode.proposers.draft_model import _draft_token

_OPTIONS = "speculative.proposer_options"


@dataclass
class _Row:
    state: DraftState
    slot: int  # slot of the request's last token (already in its block table)
    position: int  # logical position of that token
    drafts: list[int] = field(default_factory=list)


class SelfSparseProposer(Proposer):
    name = "self_sparse"

    def __init__(self, ctx: ProposerContext, budget: int = 1024, sink_pages: int = 1, recent: int = 64,
                 select_per: str = "row", gqa: str = "max", selection_layers: tuple[int, ...] | list[int] = ()):
        t = ctx.target
        if t is None or t.backend is None:
            raise InvalidRequestError("speculative.proposer", "self_sparse runs the target model in this process "
                                                              "(not with tensor/pipeline parallelism); use ngram")
        try:
            self.cfg = SparseAttentionConfig(budget=budget, sink_pages=sink_pages, recent=recent,
                                             select_per=select_per, gqa=gqa, selection_layers=selection_layers)
        except InvalidRequestError as e:  # sparse_attention.budget -> speculative.proposer_options.budget
            raise InvalidRequestError(f"{_OPTIONS}.{e.field.split('.')[-1]}", str(e)) from None
        self.runner, self.backend, self.tables, self.allocator = t.runner, t.backend, t.tables, t.allocator
        self._install()
        self.num_draft_forwards = 0  # (stats for the bench)

    def _install(self) -> None:
        """Page summaries kept exact from the first write on (engine-wide sparse attention may have done it)."""
        b = self.backend
        if b.summaries is None:
            try:
                s = b.enable_summaries()
            except ValueError as e:  # kivi4: KVFormatError (its pages keep no summaries)
                raise InvalidRequestError("speculative.proposer", f"self_sparse needs page summaries: {e}") from None
            self.allocator.add_free_hook(s.reset)
            self.tables.on_truncate.append(s.truncate)
        b.dense_decode = False

    def propose(self, state: DraftState) -> list[int]:
        return self.propose_batch([state])[0]

    def propose_batch(self, states: list[DraftState]) -> list[list[int]]:
        rows = [self._row(s) for s in states if s.max_draft > 0 and s.request_id in self.tables]
        live, prev = rows, self.backend.sparse
        self.backend.sparse = self.cfg
        try:
            while live:
                seqs = [self._seq(r) for r in live]
                out = self.runner.execute(StepBatch(seqs, return_logits=True))
                self.num_draft_forwards += 1
                nxt = []
                for r, res in zip(live, out.results):
                    r.drafts.append(_draft_token(res.logits[-1], r.state.sampling, r.drafts))
                    if len(r.drafts) < r.state.max_draft and self._grow(r):
                        nxt.append(r)
                live = nxt
        finally:
            self.backend.sparse = prev
            for r in rows:  # the verify step appends its own slots (spec_decode/step.py `_reserve_slots`)
                self.tables.truncate(r.state.request_id, r.slot + 1)
        drafts = {r.state.request_id: r.drafts for r in rows}
        return [drafts.get(s.request_id, []) for s in states]

    def _row(self, s: DraftState) -> _Row:
        t = self.tables.get(s.request_id)
        return _Row(s, t.num_slots - 1, len(s.token_ids) - 1)

    def _seq(self, r: _Row) -> SeqStep:
        """Forward j of row r: its input (the last token, then draft j - 1) into slot n + j."""
        j = len(r.drafts)
        tok = r.drafts[-1] if j else r.state.token_ids[-1]
        return SeqStep(r.state.request_id, [tok], r.position + j, r.slot + j,
                       self.tables.get(r.state.request_id).pages, [0])

    def _grow(self, r: _Row) -> bool:
        rid = r.state.request_id
        if not self.tables.fits(rid, 1):
            return False
        self.tables.append(rid, 1)
        return True
