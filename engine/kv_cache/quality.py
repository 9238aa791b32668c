"""What a compressed or thinned KV cache costs in model quality, measured through the engine's own pages:
perplexity of held-out text read through the stored pages, the passkey task, greedy agreement with the raw
format. The harness behind bench/kv/kv_quality.py (the full figures, docs/kv.md) and
tests/integration/test_kv_quality_smollm2.py (small pinned cases); bench/kv/kv_capacity.py takes its text
and config strings. Not on the serving path: nothing in the engine imports this module.

Order of a measurement: `parse_config(name)` -> (storage format, eviction, sparse attention) for an `LLM`;
`corpus_ids` cuts windows of text; then `perplexity` (chunks of queries over the pages; `scored_logprobs`
and `perplexity_of` are its two halves) or `perplexities_decode` (one token per decode step, where sparse
attention applies), `passkey` (prompts from `passkey_prompt`) and `agreement`. Each reserves its pages
and releases them, also on errors.
"""
from __future__ import annotations

import math
import random

import torch
from pydoc_data.topics import topics

from engine.batch import SeqStep, StepBatch
from engine.kv_cache.eviction import compact, keep_slots
from engine.kv_cache.sparse_config import for_request
from engine.llm import LLM
from engine.sampling_params import SamplingParams

GATES = {"int8": 0.2, "fp8": 1.0, "kivi4": 1.0}  # max perplexity change in percent (issue: int8 0.2%, 4-bit 1%)


def corpus_ids(tok, n: int, offset: int = 0) -> list[int]:
    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = tok.encode(text)
    assert len(ids) >= offset + n, f"corpus has {len(ids)} tokens"
    return ids[offset:offset + n]


def perplexity(llm: LLM, ids: list[int], prefill: int, chunk: int) -> float:
    """exp(mean NLL) of ids[prefill:] given everything before it, read through the page pool."""
    return perplexity_of(scored_logprobs(llm, ids, prefill, chunk), ids, prefill)


def perplexity_of(logp: torch.Tensor, ids: list[int], prefill: int) -> float:
    """Perplexity from `scored_logprobs`'s rows (the last one predicts past the text: not scored)."""
    nxt = torch.tensor(ids[prefill + 1:])
    return math.exp(-logp[torch.arange(len(nxt)), nxt].sum().item() / len(nxt))


def scored_logprobs(llm: LLM, ids: list[int], prefill: int, chunk: int) -> torch.Tensor:
    """Log-probabilities [len(ids) - prefill, vocab] at each scored position: prefill ids[:prefill] (its
    KV written in the engine's format), then extend over the stored pages `chunk` tokens at a time. With
    an eviction policy on the engine, the prefill's KV is thinned (as at the end of a served prefill)
    before the scored tokens extend it: slots and positions part ways as in serving."""
    res = llm.reserve(len(ids), lease_s=3600)
    policy = llm.eviction if llm.eviction is not None and llm.eviction.applies(prefill) else None
    try:
        out_logp, done, slots = [], 0, 0
        while done < len(ids):
            n = prefill if done == 0 else min(chunk, len(ids) - done)
            score = done >= prefill
            step = SeqStep("ppl", ids[done:done + n], done, slots, res.pages, list(range(n)) if score else [])
            observe = {"ppl": policy.observe()} if policy is not None and done == 0 and policy.observe() else None
            out = llm.execute(StepBatch([step], return_logits=score, observe=observe))
            slots += n
            if policy is not None and done == 0:
                # snapkv scores by the window's attention, h2o by the mass each slot received (here the
                # prompt's; decode-time h2o eviction is not simulated while scoring: see the passkey column)
                attn = {layer: rec.get("window", rec.get("slot_mass")) for (_, layer), rec in out.observations.items()}
                compact(llm.backend, res.pages, keep_slots(policy, prefill, llm.kv_spec.local_layers, attn))
                slots = policy.keep_count(prefill)
            if score:
                out_logp.append(torch.log_softmax(out.results[0].logits.float(), -1))  # [n, vocab]
            done += n
        return torch.cat(out_logp)
    finally:
        llm.allocator.cancel(res.reservation_id)


def perplexities_decode(llm: LLM, windows: list[list[int]], prefill: int, sparse=None) -> list[float]:
    """Perplexity of each window's ids[prefill:], scored one token per step (bench/kv/kv_quality.py's
    `--chunk 1`) with every window in one decode batch -- a decode step is where sparse attention applies (a
    chunk of several queries reads every page). Each window is prefilled alone first (its KV thinned by the engine's eviction policy, as
    in `scored_logprobs`). `sparse`: the rows' sparse attention option (a request's `sparse_attention`)."""
    policy = llm.eviction if llm.eviction is not None and llm.eviction.applies(prefill) else None
    res = [llm.reserve(len(ids), lease_s=3600) for ids in windows]
    rids = [f"ppl{w}" for w in range(len(windows))]
    rows = None if sparse is None else {r: for_request(llm.sparse_attention, sparse) for r in rids}
    try:
        slots = []
        for rid, ids, r in zip(rids, windows, res):
            observe = {rid: policy.observe()} if policy is not None and policy.observe() else None
            out = llm.execute(StepBatch([SeqStep(rid, ids[:prefill], 0, 0, r.pages)], observe=observe))
            if policy is not None:
                attn = {layer: rec.get("window", rec.get("slot_mass")) for (_, layer), rec in out.observations.items()}
                compact(llm.backend, r.pages, keep_slots(policy, prefill, llm.kv_spec.local_layers, attn))
            slots.append(policy.keep_count(prefill) if policy is not None else prefill)
        nll = [0.0] * len(windows)
        for t in range(prefill, len(windows[0]) - 1):  # feed token t, score token t + 1
            steps = [SeqStep(rid, [ids[t]], t, slots[w] + t - prefill, r.pages, [0])
                     for w, (rid, ids, r) in enumerate(zip(rids, windows, res))]
            out = llm.execute(StepBatch(steps, return_logits=True, sparse=rows))
            for w, (ids, result) in enumerate(zip(windows, out.results)):
                nll[w] -= torch.log_softmax(result.logits[0].float(), -1)[ids[t + 1]].item()
        return [math.exp(x / (len(windows[0]) - 1 - prefill)) for x in nll]
    finally:
        for r in res:
            llm.allocator.cancel(r.reservation_id)


def passkey_prompt(tok, length: int, depth: float, key: int) -> list[int]:
    """The passkey task of Mohtashami & Jaggi (2023): a key hidden at `depth` in repeated filler."""
    head = tok.encode("There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
                      "it. I will quiz you about the important information there.")
    unit = tok.encode(" The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.")
    needle = tok.encode(f" The pass key is {key}. Remember it. {key} is the pass key.")
    ask = tok.encode(" What is the pass key? The pass key is")
    n = max(0, length - len(head) - len(needle) - len(ask))
    body = (unit * (n // len(unit) + 1))[:n]
    at = int(n * depth) // len(unit) * len(unit)  # between two filler sentences
    return head + body[:at] + needle + body[at:] + ask


def passkey(llm: LLM, lengths, depths, trials: int, seed: int, variants: dict | None = None) -> dict:
    """Accuracy per `length@depth` cell; with `variants` (name -> a request's `sparse_attention`), one cell
    dict per variant, each prompt run by every variant in turn (prefix caching on: the later variants
    reuse the first one's prompt pages, so only their decode differs)."""
    rng = random.Random(seed)
    variants = variants or {None: None}
    cells: dict = {name: {} for name in variants}
    for length in lengths:
        for depth in depths:
            keys = [rng.randrange(10000, 100000) for _ in range(trials)]
            hits = dict.fromkeys(variants, 0)
            for k in keys:
                prompt = passkey_prompt(llm.tokenizer, length, depth, k)
                for name, sparse in variants.items():
                    out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0,
                                                                sparse_attention=sparse))[0]
                    hits[name] += str(k) in out.text
            for name in variants:
                cells[name][f"{length}@{depth}"] = hits[name] / trials
    return cells if len(variants) > 1 or None not in variants else cells[None]


def agreement(llm: LLM, ref: list[list[int]] | None, prompts, new: int, sparse=None) -> tuple[list[list[int]], list[int]]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True,
                                                sparse_attention=sparse))
    toks = [o.token_ids for o in outs]
    if ref is None:
        return toks, [new] * len(toks)
    return toks, [next((i for i, (a, b) in enumerate(zip(r, t)) if a != b), new) for r, t in zip(ref, toks)]


def parse_config(name: str) -> tuple[str, dict | None, dict | None]:
    """"int8" -> ("int8", None, None); "snapkv:0.3+int8" -> ("int8", {"method": "snapkv", "budget": 0.3, ...},
    None); "quest:1024" -> ("raw", None, {"budget": 1024}); "quest:1024:row" adds select_per "row";
    "quest:1024:layers=0.8" adds selection_layers [0, 8], "quest:1024:dense=2" dense_layers 2 (sparse decode
    attention over every page kept)."""
    if name.startswith("quest:"):
        _, budget, *opts = name.split(":")
        sparse = {"budget": int(budget)}
        for o in opts:
            if o in ("row", "kv_head"):
                sparse["select_per"] = o
            elif o.startswith("dense="):
                sparse["dense_layers"] = int(o.removeprefix("dense="))
            elif o.startswith("layers="):
                sparse["selection_layers"] = [int(x) for x in o.removeprefix("layers=").split(".")]
            else:
                raise SystemExit(f"unknown quest option {o!r} in {name!r} (row, kv_head, dense=N, layers=A.B)")
        return "raw", None, sparse
    evict, _, fmt = name.partition("+") if ":" in name else ("", "", name)
    if not evict:
        return fmt or "raw", None, None
    method, _, budget = evict.partition(":")
    return fmt or "raw", {"method": method, "budget": float(budget), "min_prompt": 64}, None
