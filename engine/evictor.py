"""`Evictor`: runs the KV-eviction policies of one engine across its steps (owned by `engine.llm.LLM`).

Per step, the LLM calls `observe(sched)` while building the batch (which requests must record attention
statistics this step, as `ObserveSpec`s) and `apply(chunks, observations)` after the forward, before the
scheduler's update. What it does (policies in `engine/kv_cache/eviction.py`):
  at the end of a prompt   snapkv / streaming / h2o keep `keep_count(prompt)` slots, compacted to the front
                           (not on a recompute after preemption: that one keeps everything)
  during decode (h2o)      heavy hitters: each step adds the attention mass every slot received (summed
                           over heads and new queries); once a sequence holds `keep + slack` slots, the
                           lowest-scoring ones outside the `window` most recent go, down to `keep` again
                           (in batches of `slack`, so the compaction copy is paid once per `slack` steps)
Speculative verify rows are not observed, so drafts never feed H2O scores; a request's scores are trimmed
when its slot count shrinks (rejected drafts rolled back) and dropped when it ends.
"""
from __future__ import annotations

import torch

from engine.kv_cache.eviction import compact, keep_slots
from engine.kv_cache.eviction_policy import EvictionPolicy, resolve


class Evictor:
    def __init__(self, llm, policy: EvictionPolicy | None):
        self.llm = llm
        self.policy = policy
        self.num_evicted_tokens = 0
        self._prompt_end: set[str] = set()  # requests whose prompt completes in the step being run
        self._scores: dict[str, dict[int, torch.Tensor]] = {}  # h2o: request -> layer -> mass per slot [slots]

    def policy_of(self, req) -> EvictionPolicy | None:
        """The engine's policy as the request's `kv_eviction` option changes it."""
        return resolve(self.policy, req.params.kv_eviction)

    def will_evict(self, req) -> bool:
        """Will this request's prompt KV be thinned at the end of its prefill?"""
        policy = self.policy_of(req)
        return policy is not None and req.num_output == 0 and policy.applies(req.num_prompt)

    def observe(self, sched) -> dict:
        """request id -> ObserveSpec for this step's batch; remembers the prompts that complete now.
        Preempted requests lose their scores (their KV is gone; a recompute starts over)."""
        out = {}
        self._prompt_end.clear()
        for rid in sched.preempted:
            self.release(rid)
        for c in sched.chunks:
            req = c.request
            policy = self.policy_of(req)
            if policy is None:
                continue
            if c.sample and c.start + c.num_tokens == req.num_prompt and self.will_evict(req):
                self._prompt_end.add(req.request_id)
            spec = policy.observe() if req.request_id in self._prompt_end else None
            if policy.method == "h2o" and policy.applies(req.num_prompt):
                spec = policy.observe()  # every step: mass accumulates over the whole life of the request
            if spec is not None:
                out[req.request_id] = spec
        return out

    def apply(self, chunks, observations: dict) -> None:
        for c in chunks:
            req = c.request
            policy = self.policy_of(req)
            if policy is None:
                continue
            if policy.method == "h2o" and policy.applies(req.num_prompt):
                self._accumulate(req.request_id, observations)
            if req.request_id in self._prompt_end:
                self._evict(req, policy, policy.keep_count(req.num_prompt), observations)
            elif policy.method == "h2o" and req.request_id in self._scores:
                n = self.llm.tables.get(req.request_id).num_slots
                keep = policy.keep_count(req.num_prompt)
                if n >= keep + policy.slack:
                    self._evict(req, policy, keep, observations)

    def release(self, request_id: str) -> None:
        self._scores.pop(request_id, None)

    # ---- internals ---------------------------------------------------------------------------
    def _accumulate(self, rid: str, observations: dict) -> None:
        """Add this step's attention mass per slot (H2O's accumulated score: a plain sum, which favours
        slots many queries saw; a per-query mean was tried and lost passkeys at depth 0.1 on SmolLM2)."""
        n = self.llm.tables.get(rid).num_slots
        scores = self._scores.setdefault(rid, {})
        for layer in self.llm.kv_spec.local_layers:
            mass = observations.get((rid, layer), {}).get("slot_mass")
            old = scores.get(layer, torch.zeros(0))[:n]
            new = torch.zeros(n)
            new[:len(old)] = old
            if mass is not None:
                m = min(n, len(mass))
                new[:m] += mass[:m].float()
            scores[layer] = new

    def _evict(self, req, policy: EvictionPolicy, keep: int, observations: dict) -> None:
        rid = req.request_id
        table = self.llm.tables.get(rid)
        n = table.num_slots
        if policy.method == "h2o":
            stats = self._scores.get(rid, {})
        else:
            stats = {layer: observations[(rid, layer)]["window"] for layer in self.llm.kv_spec.local_layers
                     if (rid, layer) in observations}
        kept = keep_slots(policy, n, self.llm.kv_spec.local_layers, stats, keep)
        compact(self.llm.backend, table.pages, kept)
        self.llm.tables.truncate(rid, keep)
        if policy.method == "h2o":
            self._scores[rid] = {layer: s[kept[layer]] for layer, s in stats.items()}
        self.num_evicted_tokens += n - keep
