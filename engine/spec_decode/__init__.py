"""Draft-verify (speculative) decoding for `engine.LLM` and the decode worker built on it.

Map (who calls what, in order, once per engine step when `LLM(speculative=...)` is set):

    LLM.step -> scheduler.schedule() -> SpecDecoder.step(sched)            (step.py)
        plan: per decode request a draft length from its acceptance (policy.AcceptanceTracker), drafts
              from the request's proposer (proposers/, registered by name), then the load-aware gate
              (policy.choose_lengths over policy.CostModel, fitted to measured plain steps, and
              policy.VerifyScale, a draft token's measured cost: expected tokens/s of this batch with vs
              without each draft token; while no request waits, drafts off the batch's critical path
              must pay in saved rows alone: policy.drain_lengths) trims or drops them; draft slots
              are appended to the block table only when pages are free (drafts never preempt)
        run:  one ragged forward: plain chunks as usual, each drafted request brings [last] + draft with
              logits at every position
        verify (verify.py, pure): every row is sampled by the ordinary keyed sampler, then the longest
              prefix where draft == target is accepted plus the target token after it
        commit: accepted tokens one at a time (EOS, stop ids, max_tokens, stop strings end the run),
              rejected draft slots rolled back (`BlockTables.truncate` frees whole pages)

Why verification samples every row with the keyed sampler: the noise for output index j depends only on
(request seed, j), so a drafted request emits exactly the tokens it would have emitted without drafts
(greedy or sampled), whatever the proposer, the gate or the batch. With deterministic proposals (every
proposer here is deterministic: q is one-hot) this accepts draft token d with probability p(d) and on
rejection emits a sample of p restricted to tokens != d, which is Leviathan et al.'s rejection sampling
for one-hot q; `verify.rejection_sample` is the general form (any q), kept as the reference.

Drafts live only in slots past the committed ones and are rolled back or accepted within the step, so
nothing evicts or quantizes them before acceptance (compressed/evicted KV must keep that rule).

Where this lives: proposers sit here, under engine/, not in decode_worker/, because the standalone and
colocated `LLM` speculate too and engine/ may not import decode_worker/; the decode worker passes its
`SpeculativeConfig` through to its `LLM`.
"""
from engine.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
