"""`SpecDecoder`: the speculative step of `engine.LLM` (plan drafts -> one ragged forward -> verify -> commit).

Built by `LLM(speculative=...)`; `LLM.step` hands it every non-empty `SchedulerOutput`. Decode chunks (one
new token, sampled) may get drafts; every other chunk runs exactly as in a plain step (`LLM._batch` and
`LLM._finish_step`). For a drafted request the step:
  1. appends k draft slots to its block table (only if pages are free and the step's token budget
     allows: drafts never preempt anyone) and brings [last token] + draft, logits at all k + 1 rows;
  2. samples every row with the keyed sampler (row j is output index num_output + j and sees the draft
     prefix as outputs, for penalties) and accepts the longest prefix equal to the draft, plus one token
     (`verify.verify_greedy`): the request's tokens are exactly its non-speculative tokens;
  3. rolls back the k - m rejected slots (`BlockTables.truncate` frees pages left empty), then appends
     the m + 1 tokens one at a time with the plain step's stop rules (EOS / stop ids / max_tokens in the
     scheduler, stop strings through the output processor), so a stop inside the run ends it there.
Proposers learn from every row with logits (`observe`); state of ended requests is released at the end
of each step and on abort.
"""
from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from engine.batch import SeqResult, SeqStep, StepBatch
from engine.device_sampler import sample_step
from engine.errors import InvalidRequestError
from engine.outputs import RequestOutput
from engine.sampler import SampleRequest
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledChunk, SchedulerOutput
from engine.spec_decode.config import PER_REQUEST_PROPOSERS, SpeculativeConfig
from engine.spec_decode.policy import (AcceptanceTracker, CostModel, SpecStats, VerifyScale, choose_lengths,
                                      critical_shares, expected_tokens)
from engine.spec_decode.proposers import DraftState, Proposer, ProposerContext, TargetParts, make_proposer
from engine.spec_decode.verify import accepted_length


@dataclass
class SpecHost:
    """What the speculative step may use of its engine (`LLM` builds it): its parts and three of its steps,
    nothing else. The parts are the engine's own objects (shared, not copies)."""

    config: object  # the model's ModelConfig
    model_dir: object
    dtype: str
    device_type: str  # "cpu": the gate times CPU time; else wall time
    runner: object
    backend: object
    tables: object
    allocator: object
    scheduler: object
    outputs: object  # the OutputProcessor (stop strings, text)
    requests: dict  # request id -> Request, live ones (EOS ids: scheduler.eos, read at each use)
    keep_logits: bool
    clock: Callable[[], float]
    plain_batch: Callable  # SchedulerOutput -> StepBatch, as a plain step builds it
    finish_plain: Callable  # (SchedulerOutput, results, observations) -> outputs, as a plain step applies them
    output: Callable  # Request -> RequestOutput (finishing it on a stop string)


class SpecDecoder:
    def __init__(self, llm: SpecHost, cfg: SpeculativeConfig, timer=None):
        # On CPU the step's cost is this thread's CPU time (one torch thread runs on it): what other
        # processes on a shared machine do then barely moves the gate. On an accelerator: wall time.
        if timer is None:
            timer = time.thread_time if llm.device_type == "cpu" else time.perf_counter
        self.llm, self.cfg, self.timer = llm, cfg, timer  # (`llm`: the host's view of its engine)
        self.ctx = ProposerContext(llm.config.vocab_size, llm.model_dir, llm.dtype,
                                   TargetParts(llm.runner, llm.backend, llm.tables, llm.allocator))
        self.proposers: dict[str, Proposer] = {cfg.proposer: make_proposer(cfg.proposer, self.ctx,
                                                                           **cfg.proposer_options)}
        self.trackers: dict[str, AcceptanceTracker] = {}
        self.cost = CostModel()  # plain decode steps: seconds = a + b x rows
        self.verify_scale = VerifyScale()  # a verified draft token's cost in units of b, measured
        self.draft_cost = 0.0  # seconds per drafted token spent in proposers (decayed average)
        self._draft_cost_seen = 0  # proposer calls measured
        self._t_proposers = 0.0  # proposer seconds of the current step
        self.stats = SpecStats()

    # ---- intake ------------------------------------------------------------------------------
    def check(self, params: SamplingParams) -> None:
        o = params.speculative
        if o is not None and o.proposer is not None and o.proposer not in self.proposers \
                and o.proposer not in PER_REQUEST_PROPOSERS:
            raise InvalidRequestError("speculative.proposer", f"{o.proposer!r} is not available here; use "
                                                              f"{', '.join(sorted({*self.proposers, *PER_REQUEST_PROPOSERS}))}")

    def proposer(self, name: str) -> Proposer:
        if name not in self.proposers:
            self.proposers[name] = make_proposer(name, self.ctx)
        return self.proposers[name]

    def release(self, request_id: str) -> None:
        self.trackers.pop(request_id, None)
        for p in self.proposers.values():
            p.release(request_id)

    # ---- the step ----------------------------------------------------------------------------
    def step(self, sched: SchedulerOutput) -> list[RequestOutput]:
        llm = self.llm
        t_start, self._t_proposers = self.timer(), 0.0
        drafts = self._plan(sched)
        t_proposers = self._t_proposers
        self.stats.num_spec_steps += bool(drafts)
        plain = SchedulerOutput([c for c in sched.chunks if c.request.request_id not in drafts], sched.preempted)
        verify = sorted((c for c in sched.chunks if c.request.request_id in drafts),
                        key=lambda c: len(drafts[c.request.request_id]))  # equal lengths share one SDPA call
        batch = llm.plain_batch(plain)
        batch.seqs += [self._verify_seq(c, drafts[c.request.request_id]) for c in verify]
        batch.return_logits = True
        out = llm.runner.execute(batch)
        self._observe(batch, out.results)
        n = len(plain.chunks)
        outs = llm.finish_plain(plain, out.results[:n], out.observations) if n else []
        outs += [self._commit(c, drafts[c.request.request_id], r) for c, r in zip(verify, out.results[n:])]
        # The gate weighs whole decode steps (forward, sampling every verify row, commits), proposers
        # apart. Steps with prefill chunks are left out: a prompt token costs far less than a verified one
        # (no LM-head row, no sampling), so they would teach the model a slope too low for drafts. Plain
        # steps fit a + b x rows; drafted ones measure the draft tokens' cost on top (`VerifyScale`).
        if all(c.num_tokens == 1 for c in sched.chunks):
            seconds, base = self.timer() - t_start - t_proposers, len(sched.chunks)
            if drafts and self.cost.weight >= 2.0:  # (until plain steps were measured: tokens, as one fit)
                plain_s = self.cost.predict(base)
                self.verify_scale.observe(seconds, plain_s, self.cost.predict(base + 1) - plain_s,
                                          batch.num_tokens - base)
            else:
                self.cost.observe(batch.num_tokens, seconds)
        self.stats.verify_token_cost = self.verify_scale.value
        for rid in [r for r in self.trackers if r not in llm.requests]:
            self.release(rid)
        return outs

    def _eligible(self, c: ScheduledChunk) -> bool:
        req = c.request
        o = req.params.speculative
        return (c.sample and c.num_tokens == 1 and req.num_output >= 1 and not req.prefill_only
                and c.start == len(req.token_ids) - 1 and req.num_output < req.params.max_tokens - 1
                and (o is None or o.enabled))

    def _plan(self, sched: SchedulerOutput) -> dict[str, list[int]]:
        """request id -> draft to verify this step (its slots already appended to the block table)."""
        cands = [c for c in sched.chunks if self._eligible(c)]
        if not cands:
            return {}
        self.stats.num_steps += 1
        groups: dict[str, list[DraftState]] = defaultdict(list)
        for c in cands:
            req, o = c.request, c.request.params.speculative
            cap = o.max_draft if o is not None and o.max_draft is not None else self.cfg.max_draft
            cap = min(cap, req.params.max_tokens - req.num_output - 1)
            tr = self.trackers.setdefault(req.request_id, AcceptanceTracker())
            k = tr.draft_len(cap, self.cfg.min_accept) if self.cfg.adaptive else cap
            if k > 0:
                name = o.proposer if o is not None and o.proposer else self.cfg.proposer
                sampling = None if req.params.greedy else SampleRequest(
                    req.params, req.seed, req.num_output, req.prompt_token_ids, req.output_token_ids,
                    self.llm.scheduler.eos)
                groups[name].append(DraftState(req.request_id, req.token_ids, req.num_prompt, k, sampling))
        base = sum(c.num_tokens for c in sched.chunks)
        rows = sum(c.sample for c in sched.chunks)  # tokens the step emits without drafts
        planned = {s.request_id: s.max_draft for ss in groups.values() for s in ss}
        if self.cfg.gate and planned and not any(self._gate(sched, base, rows, planned)):
            self.stats.num_gated += 1  # not even the planned lengths pay: do not spend proposer time
            self.verify_scale.refused()
            return {}
        drafts = self._propose(groups)
        if not drafts:
            return {}
        if self.cfg.gate:
            lens = self._gate(sched, base, rows, {r: len(d) for r, d in drafts.items()})
            drafts = {r: d[:n] for (r, d), n in zip(drafts.items(), lens) if n}
            if not drafts:
                self.stats.num_gated += 1
                self.verify_scale.refused()
                return {}
        else:
            n = sum(map(len, drafts.values()))
            t_plain = self.cost.predict(base)
            slope = self.cost.predict(base + 1) - t_plain
            self.stats.verify_cost_ratio = 1.0 + slope * self.verify_scale.value * n / t_plain
        return self._reserve_slots(cands, drafts, self.llm.scheduler.cfg.max_num_batched_tokens - base)

    def _gate(self, sched: SchedulerOutput, base: int, rows: int, avail: dict[str, int]) -> list[int]:
        """Draft tokens to verify per request of `avail` (request id -> drafts it has or would plan)."""
        rids = list(avail)
        lens, self.stats.verify_cost_ratio = choose_lengths(
            self.cost, base, list(avail.values()), [self.trackers[r].alpha for r in rids], self.cfg.gate_margin,
            self.draft_cost, rows, self.verify_scale.value, self._shares(sched, rids))
        return lens

    def _shares(self, sched: SchedulerOutput, rids: list[str]) -> list[float] | None:
        """Per drafting request, the share of a step's fixed cost one accepted token saves (see
        policy.drain_lengths, policy.critical_shares); None while requests wait (a freed slot is
        refilled: 1/n for every row); on a decode worker, requests whose KV is on its way hold page
        reservations: they wait too."""
        if self.llm.scheduler.waiting or self.llm.allocator.num_reservations:
            return None
        left = {c.request.request_id: c.request.params.max_tokens - c.request.num_output for c in sched.chunks}
        top = max(left, key=left.get)
        tr = self.trackers.get(top)
        rate = expected_tokens(tr.alpha, tr.draft_len(self.cfg.max_draft, self.cfg.min_accept)) if tr else 1.0
        return critical_shares(left, rids, rate, self.cfg.max_draft)

    def _propose(self, groups: dict[str, list[DraftState]]) -> dict[str, list[int]]:
        t0, drafts = self.timer(), {}
        for name, states in groups.items():
            for s, d in zip(states, self.proposer(name).propose_batch(states)):
                if d:
                    drafts[s.request_id] = [int(t) for t in d[:s.max_draft]]
        self._t_proposers = self.timer() - t0
        n = sum(map(len, drafts.values()))
        if n:  # (the first reading as it is: an average rising from 0 let a costly proposer (self_sparse
            # at batch 1) draft for a dozen steps before the gate saw its cost)
            per = self._t_proposers / n
            self.draft_cost = per if self._draft_cost_seen == 0 else 0.8 * self.draft_cost + 0.2 * per
            self._draft_cost_seen += 1
        return drafts

    def _reserve_slots(self, cands, drafts: dict[str, list[int]], budget: int) -> dict[str, list[int]]:
        tables, out = self.llm.tables, {}
        for c in cands:
            rid = c.request.request_id
            n = min(len(drafts.get(rid, ())), max(budget, 0))
            while n and not tables.fits(rid, n):
                n -= 1
            if n:
                tables.append(rid, n)
                out[rid] = drafts[rid][:n]
                budget -= n
        return out

    def _verify_seq(self, c: ScheduledChunk, draft: list[int]) -> SeqStep:
        req = c.request
        t = self.llm.tables.get(req.request_id)
        assert t.num_slots == c.num_cached + 1 + len(draft)
        return SeqStep(req.request_id, [req.token_ids[c.start]] + draft, c.start, c.num_cached, t.pages,
                       list(range(len(draft) + 1)))

    def _observe(self, batch: StepBatch, results: list[SeqResult]) -> None:
        learners = [p for p in self.proposers.values() if type(p).observe is not Proposer.observe]
        if not learners:
            return
        for s, r in zip(batch.seqs, results):
            if s.logits_at:
                ids = [s.token_ids[i] for i in s.logits_at]
                for p in learners:
                    p.observe(ids, r.logits)

    def _commit(self, c: ScheduledChunk, draft: list[int], r: SeqResult) -> RequestOutput:
        llm, req, k = self.llm, c.request, len(draft)
        rows = r.logits.cpu()  # [k + 1, vocab]
        outs = req.output_token_ids
        # row j is output index num_output + j: penalties see draft[:j], min_tokens masks by that index
        reqs = [SampleRequest(req.params, req.seed, req.num_output + j, req.prompt_token_ids, outs + draft[:j],
                              llm.scheduler.eos) for j in range(k + 1)]
        targets = sample_step(rows, reqs, llm.runner.sampler)  # the plain step's sampler: lossless
        m = accepted_length(draft, [t.token_id for t in targets])
        self.trackers[req.request_id].update(k, m)
        st = self.stats
        st.num_verifies += 1
        st.num_drafted += k
        st.num_accepted += m
        st.num_emitted += m + 1
        req.num_computed += 1 + m  # the last token and the accepted drafts now have KV
        if m < k:
            t = llm.tables.get(req.request_id)
            llm.tables.truncate(req.request_id, t.num_slots - (k - m))
        now = llm.clock()
        for j in range(m + 1):
            reason = llm.scheduler.append_output(req, targets[j], now)
            if llm.keep_logits:
                req.logits.append(rows[j].clone())
            if reason:
                llm.scheduler.finish(req, reason)
                break
            if j < m and llm.outputs.advance(req):  # (the last token is folded in by `_output`)
                llm.scheduler.finish(req, "stop")
                break
        return llm.output(req)
