"""Speculative decoding benchmark: the same engine with vs without draft-verify, side by side, as ratios.

Workloads (SmolLM2-135M-Instruct, chat template, greedy, ending at EOS or --new tokens; both sides make
the same tokens, up to near-ties in bfloat16 (column `same`), and tokens/s counts what each side made):
  copy   rewrite/edit a given passage (stdlib documentation) or a piece of code: most output tokens
         occur in the prompt, so prompt-lookup drafts land. Concurrency 1 and 4.      target >= 2x
  chat   open-ended questions: drafts rarely land; the gate must keep speculation from hurting.
         Concurrency 1, 4 and 16.                                                    target >= 0.97x
For each cell the plain and the speculative engine run interleaved (plain, spec, spec, plain, plain, ...
--repeats pairs, the order alternating so a drifting load favours neither side): output tokens/s and TPOT (time per output token after the first) as the median of
the ratios of adjacent runs, tokens per CPU-second of this process (robust to other processes' load), and the speculation counters of the spec runs: acceptance rate, tokens per verify, share of steps
speculated, the gate's last cost estimate (`gate cost`) and its measured cost of one verified draft token
in units of one decode row (`draft tok`). `verify` measures the forward cost the gate learns: one
decode step at batch B with k + 1 tokens per sequence against 1 token (context ~300).

Run:   .venv/bin/python bench/engine/spec_decode_bench.py [--dtype bfloat16] [--proposer ngram] [--repeats 2]
                                                   [--quick] [--only copy chat verify] [--cells chat:16]
Writes bench/out/spec_decode_<proposer>_<dtype>.json (or --out). The machine is shared and noisy: read
ratios from one interleaved run, not absolute numbers.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from pydoc_data.topics import topics

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine import LLM, SamplingParams  # noqa: E402
from engine.batch import SeqStep, StepBatch  # noqa: E402

now = time.perf_counter
CODE = '''def merge_intervals(intervals):
    intervals = sorted(intervals, key=lambda x: x[0])
    merged = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged
'''
EDITS = ["Rewrite the following text, fixing any typos and keeping everything else the same:\n\n{}",
         "Repeat the following passage exactly, then stop:\n\n{}",
         "Rename the function to `combine` and return the code unchanged otherwise:\n\n{}",
         "Copy this text and add a title line at the top:\n\n{}"]
QUESTIONS = ["Tell me a short story about a robot who learns to paint.", "What are good habits for studying?",
             "Explain why the sky is blue to a child.", "Give me ideas for a weekend trip in the mountains.",
             "What is the difference between weather and climate?", "Write a poem about autumn leaves.",
             "How do I start learning to play the guitar?", "Describe your ideal breakfast.",
             "What makes a good team leader?", "Suggest a name for a coffee shop and explain it.",
             "Why do cats purr?", "How does a bicycle stay upright?", "Plan a birthday party for a ten-year-old.",
             "What should I pack for a beach holiday?", "Explain recursion with an everyday example.",
             "What are the pros and cons of working from home?"]


def passage(i: int, words: int = 90) -> str:
    keys = ["for", "with", "import", "class", "try", "while", "lambda", "assert"]
    return " ".join(topics[keys[i % len(keys)]].split()[:words])


def workload(llm: LLM, kind: str, n: int) -> list[list[int]]:
    msgs = []
    for i in range(n):
        if kind == "copy":
            body = CODE if i % 4 == 2 else passage(i)
            msgs.append(EDITS[i % len(EDITS)].format(body))
        else:
            msgs.append(QUESTIONS[i % len(QUESTIONS)])
    return [llm.tokenizer.apply_chat_template([{"role": "user", "content": m}]) for m in msgs]


def run_cell(llm: LLM, prompts: list[list[int]], new: int) -> dict:
    """All prompts at once; output tokens/s over the whole run and the mean TPOT of the requests."""
    params = SamplingParams(max_tokens=new, temperature=0.0)
    before = dict(llm.spec_stats())
    t0, c0 = now(), time.process_time()
    ids = [llm.add_request(p, params) for p in prompts]
    first, done, tokens = {}, {}, {}
    while llm.has_unfinished():
        for o in llm.step():
            t = now()
            first.setdefault(o.request_id, t)
            if o.finished:
                done[o.request_id], tokens[o.request_id] = t, o.token_ids
    wall, cpu = now() - t0, time.process_time() - c0
    n_out = sum(len(tokens[i]) for i in ids)
    tpot = statistics.mean((done[i] - first[i]) / max(1, len(tokens[i]) - 1) for i in ids)
    after = llm.spec_stats()
    spec = {k: after[k] - before.get(k, 0) for k in ("num_steps", "num_spec_steps", "num_gated", "num_verifies",
                                                      "num_drafted", "num_accepted", "num_emitted")} if after else {}
    if spec:
        spec["verify_cost_ratio"] = after["verify_cost_ratio"]
        spec["verify_token_cost"] = after.get("verify_token_cost", 1.0)
    return {"tok_s": n_out / wall, "tok_cpu_s": n_out / cpu, "tpot_ms": 1000 * tpot,
            "tokens": [tokens[i] for i in ids], "spec": spec}


def measure_cell(plain: LLM, spec: LLM, kind: str, conc: int, new: int, repeats: int) -> dict:
    prompts = workload(plain, kind, conc)
    runs = {"plain": [], "spec": []}
    for i in range(repeats):  # the order alternates: a load that drifts within a pair does not favour one side
        for name, llm in (("plain", plain), ("spec", spec))[::1 if i % 2 == 0 else -1]:
            runs[name].append(run_cell(llm, prompts, new))
    med = {n: {k: statistics.median(r[k] for r in rs) for k in ("tok_s", "tok_cpu_s", "tpot_ms")}
           for n, rs in runs.items()}
    pairs = list(zip(runs["plain"], runs["spec"]))  # adjacent runs saw about the same machine load

    def ratio(key: str) -> float:
        return statistics.median(s[key] / p[key] for p, s in pairs)

    agg: dict = {}
    for r in runs["spec"]:
        for k, v in r["spec"].items():
            agg[k] = agg.get(k, 0) + v if k not in ("verify_cost_ratio", "verify_token_cost") else v
    same = sum(a == b for a, b in zip(runs["plain"][0]["tokens"], runs["spec"][0]["tokens"]))
    return {"workload": kind, "concurrency": conc, "plain": med["plain"], "spec": med["spec"],
            "tok_s_ratio": ratio("tok_s"), "tok_cpu_s_ratio": ratio("tok_cpu_s"), "tpot_ratio": ratio("tpot_ms"),
            "acceptance": agg["num_accepted"] / agg["num_drafted"] if agg.get("num_drafted") else 0.0,
            "tokens_per_verify": agg["num_emitted"] / agg["num_verifies"] if agg.get("num_verifies") else 0.0,
            "spec_share": agg["num_spec_steps"] / agg["num_steps"] if agg.get("num_steps") else 0.0,
            "gate_cost_ratio": agg.get("verify_cost_ratio", 1.0), "draft_token_cost": agg.get("verify_token_cost", 1.0),
            "identical_outputs": f"{same}/{conc}"}


def measure_verify(llm: LLM, batch: int, k: int, ctx: int = 300, reps: int = 7) -> dict:
    """Forward seconds of one step at `batch` sequences: k + 1 new tokens each vs 1 (context `ctx`)."""
    ids = [f"v{i}" for i in range(batch)]
    for rid in ids:
        llm.tables.append(rid, ctx + k + 1)
    times = {}
    for q in (1, k + 1):
        seqs = [SeqStep(rid, [11] * q, ctx, ctx, llm.tables.get(rid).pages, list(range(q))) for rid in ids]
        llm.execute(StepBatch(seqs, return_logits=True))  # warm-up
        samples = []
        for _ in range(reps):
            t0 = now()
            llm.execute(StepBatch(seqs, return_logits=True))
            samples.append(now() - t0)
        times[q] = min(samples)  # best of: the machine is shared
    for rid in ids:
        llm.tables.free(rid)
    return {"batch": batch, "k": k, "ms_1": 1000 * times[1], "ms_k1": 1000 * times[k + 1],
            "cost_ratio": times[k + 1] / times[1]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--proposer", default="ngram", choices=["ngram", "recycling"])
    ap.add_argument("--max-draft", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--new", type=int, default=160, help="output tokens per request, at most")
    ap.add_argument("--quick", action="store_true", help="96 tokens, one repeat, chat up to 4")
    ap.add_argument("--only", nargs="*", default=["copy", "chat", "verify"])
    ap.add_argument("--cells", nargs="*", help="only these cells, e.g. copy:1 chat:16")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    new, repeats = (96, 1) if a.quick else (a.new, a.repeats)
    kw = dict(dtype=a.dtype, page_size=16, num_pages=2048, max_num_seqs=32)
    plain = LLM(**kw)
    spec = LLM(**kw, speculative={"proposer": a.proposer, "max_draft": a.max_draft})
    for llm in (plain, spec):  # warm-up
        llm.generate(workload(llm, "copy", 1), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    cells = [("copy", c) for c in (1, 4)] + [("chat", c) for c in ((1, 4) if a.quick else (1, 4, 16))]
    rows, verify = [], []
    print(f"{'workload':8} {'conc':>4} {'plain tok/s':>11} {'spec tok/s':>10} {'ratio':>6} {'cpu ratio':>9} {'TPOT ratio':>10} "
          f"{'accept':>6} {'tok/verify':>10} {'spec share':>10} {'gate cost':>9} {'draft tok':>9} {'same':>6}")
    for kind, conc in cells:
        if kind not in a.only or (a.cells and f"{kind}:{conc}" not in a.cells):
            continue
        r = measure_cell(plain, spec, kind, conc, new, repeats)
        rows.append(r)
        print(f"{kind:8} {conc:>4} {r['plain']['tok_s']:>11.1f} {r['spec']['tok_s']:>10.1f} {r['tok_s_ratio']:>5.2f}x "
              f"{r['tok_cpu_s_ratio']:>8.2f}x {r['tpot_ratio']:>9.2f}x {r['acceptance']:>6.2f} {r['tokens_per_verify']:>10.2f} "
              f"{r['spec_share']:>10.2f} {r['gate_cost_ratio']:>9.2f} {r['draft_token_cost']:>9.2f} {r['identical_outputs']:>6}",
              flush=True)
    if "verify" in a.only:
        for b in (1, 4, 16):
            v = measure_verify(plain, b, a.max_draft)
            verify.append(v)
            print(f"verify cost batch {b:>2}: {v['ms_1']:.1f} ms (1 token) vs {v['ms_k1']:.1f} ms "
                  f"({a.max_draft + 1} tokens) = {v['cost_ratio']:.2f}x", flush=True)
    out = a.out or ROOT / "bench" / "out" / f"spec_decode_{a.proposer}_{a.dtype}{'_quick' if a.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(a) | {"out": str(out)}, "cells": rows, "verify": verify}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
