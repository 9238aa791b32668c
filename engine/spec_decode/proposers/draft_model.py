"""`draft_model`: a small causal LM with the target's vocabulary proposes drafts.

The draft model runs in this process on its own `engine.LLM` (its own weights, page pool and block
tables; its scheduler is unused: this proposer schedules for itself). Per request it keeps KV for a prefix
of the request's tokens: `(n, tail)` = the first n committed tokens plus the drafts it fed last time.
Each `propose_batch`:
  1. catch up: keep the cached tail while it matches what the target committed, roll back the rest
     (`BlockTables.truncate`), feed the missing tokens (>= 1) in one ragged forward -> first draft;
  2. k - 1 batched one-token forwards -> the other drafts.
Greedy requests get argmax drafts. Sampling requests get drafts *sampled with their own keyed noise*:
draft j is the keyed sampler (engine/sampler.py, exponential race) applied to the draft model's logits with
the request's params, seed and output index num_output + j -- the same noise the target's verify row j
uses. Verification stays exact equality with the target's keyed sample (verify.py), so the output is
exactly plain decoding's; the coupling makes the two samples agree whenever the two distributions do
(Gumbel-max coupling: P[equal] >= (1 - TV) / (1 + TV)), where argmax drafts would be accepted only with
the target's probability of the argmax.
Drafting stops for a request when its pool has no free page (never an error). Testing with the target's
own weights gives an always-right oracle (up to float near-ties).
"""
from __future__ import annotations

import dataclasses

import torch

from engine.batch import SeqStep, StepBatch
from engine.errors import InvalidRequestError
from engine.sampler import SampleRequest, sample_one
from engine.spec_decode.proposers import DraftState, Proposer, ProposerContext


class DraftModelProposer(Proposer):
    name = "draft_model"

    def __init__(self, ctx: ProposerContext, model: str | None = None, dtype: str | None = None,
                 num_pages: int = 512, page_size: int = 16):
        from engine.llm import LLM  # engine.llm builds this proposer lazily: no import cycle at load time

        self.llm = LLM(model=model or str(ctx.model_dir), dtype=dtype or ctx.dtype, page_size=page_size,
                       num_pages=num_pages, num_threads=None)
        if self.llm.config.vocab_size != ctx.vocab_size:
            raise InvalidRequestError("speculative.proposer_options.model",
                                      f"draft vocabulary {self.llm.config.vocab_size} != target's {ctx.vocab_size}")
        self.tables = self.llm.tables
        self._cached: dict[str, tuple[int, list[int]]] = {}  # rid -> (committed prefix length, fed drafts)

    def propose(self, state: DraftState) -> list[int]:
        return self.propose_batch([state])[0]

    def propose_batch(self, states: list[DraftState]) -> list[list[int]]:
        drafts: dict[str, list[int]] = {s.request_id: [] for s in states}
        by_id = {s.request_id: s for s in states}
        seqs, want = [], {}
        for s in states:
            if s.max_draft <= 0:
                continue
            p = self._sync(s)
            new = s.token_ids[p:]
            if not self._grow(s.request_id, len(new)):
                continue
            seqs.append(self._seq(s.request_id, new, p))
            want[s.request_id] = s.max_draft
        while seqs:
            out = self.llm.runner.execute(StepBatch(seqs, return_logits=True))
            nxt = []
            for seq, r in zip(seqs, out.results):
                rid = seq.request_id
                tok = _draft_token(r.logits[-1], by_id[rid].sampling, drafts[rid])
                drafts[rid].append(tok)
                if len(drafts[rid]) < want[rid] and self._grow(rid, 1):
                    nxt.append(self._seq(rid, [tok], seq.position_start + len(seq.token_ids)))
            seqs = nxt
        for s in states:
            if s.request_id in want and s.request_id in self.tables:
                fed = drafts[s.request_id][:self.tables.get(s.request_id).num_slots - len(s.token_ids)]
                self._cached[s.request_id] = (len(s.token_ids), fed)
        return [drafts[s.request_id] for s in states]

    def _sync(self, s: DraftState) -> int:
        """Roll the draft cache back to its longest prefix that the target committed; the cached length."""
        n, tail = self._cached.get(s.request_id, (0, []))
        ids, a = s.token_ids, 0
        while a < len(tail) and n + a < len(ids) - 1 and tail[a] == ids[n + a]:
            a += 1
        p = min(n + a, len(ids) - 1)  # feed at least the last token: its logits give the first draft
        if s.request_id in self.tables:
            self.tables.truncate(s.request_id, p)
        return p

    def _grow(self, rid: str, n: int) -> bool:
        if not self.tables.fits(rid, n):
            self.release(rid)
            return False
        self.tables.append(rid, n)
        return True

    def _seq(self, rid: str, tokens: list[int], start: int) -> SeqStep:
        t = self.tables.get(rid)
        return SeqStep(rid, list(tokens), start, t.num_slots - len(tokens), t.pages, [len(tokens) - 1])

    def release(self, request_id: str) -> None:
        self.tables.free(request_id)
        self._cached.pop(request_id, None)

    def kv_usage(self) -> dict[str, int]:
        return self.llm.kv_usage()


def _draft_token(logits: torch.Tensor, sampling: SampleRequest | None, drafted: list[int]) -> int:
    """logits: [vocab] of the draft model at the next draft position (see the module map)."""
    if sampling is None:
        return int(torch.argmax(logits))
    params = sampling.params if sampling.params.logprobs is None else dataclasses.replace(sampling.params, logprobs=None)
    req = SampleRequest(params, sampling.seed, sampling.output_index + len(drafted), sampling.prompt_token_ids,
                        list(sampling.output_token_ids) + drafted, sampling.eos_token_ids)
    return sample_one(logits.float(), req).token_id
