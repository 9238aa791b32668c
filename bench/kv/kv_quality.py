"""KV quality harness: what a compressed KV cache costs in model quality, per storage format.

For each config -- a storage format (raw = the baseline, int8, fp8, kivi4) and optionally an eviction policy
applied at the end of prefill (snapkv / streaming at a budget) -- on the same model, dtype and text:
  ppl       perplexity of held-out text read through the stored pages: prefill `--prefill` tokens (their
            KV is written in the format, and the prefill itself reads it back), then score the next
            `--score` tokens in chunks of `--chunk` (<= 128: at most that many tokens per step are still
            only in flight, the rest is read from pages). Change vs raw in percent, per window of text
            (`--windows` consecutive ones) and their mean +- standard error; the gate applies to the mean.
            Why several: in bf16 one window's change is mostly compute noise -- repacking the weights for
            another GEMM blocking moved raw's own perplexity by +0.55% at 1,024 + 256 (while int8 pages
            differ from raw by the same KL per token as that repacking, ~0.002 nats); six windows of 2,048 +
            512 put int8 at +0.15% +- 0.17% (per-window sd 0.42%).
  passkey   the passkey task (Mohtashami & Jaggi 2023): a 5-digit key hidden at `--depths` of repeated
            filler, `--lengths` tokens in all; greedy answer after "What is the pass key?"; accuracy over
            `--trials` keys per cell, and vs raw.
  agree     greedy-agreement length: tokens generated before the first divergence from raw (mean, min)
            over `--agree-prompts` real-text prompts, `--agree-tokens` new tokens each.
  bytes     KV bytes per prompt token vs raw (format size x share kept): what crosses the wire.
kivi4 (engine/kv_cache/kivi.py) reads the page a query sits in from full precision: its tail is at most
page_size - 1 tokens (15 here), well inside the 128 the issue allows; every earlier page is read as 4 bits.
Text: the stdlib's pydoc topics (real English prose; not used to pick any setting).
Sparse decode attention (`quest:BUDGET[:row][:dense=N][:layers=A.B]`, engine/kv_cache/sparse.py) keeps every token and reads
only chosen pages per decode step: raw and the quest configs share one engine (a request's `sparse_attention`
picks the variant; prefix caching lets every variant reuse a passkey prompt's prefill), and perplexity is then
scored one token per decode step for every config (`--chunk 1`: chunks of several queries read every page).
Run:  .venv/bin/python bench/kv/kv_quality.py [--configs raw,int8,snapkv:0.3+int8] [--dtype bfloat16] [--quick]
      .venv/bin/python bench/kv/kv_quality.py --configs raw,quest:1024,quest:1024:row,snapkv:1024,streaming:1024,h2o:1024 \
          --lengths 2048,4096,8180 --prefill 2048 --score 128   (8180: prompt + 6 answer tokens fit SmolLM2's 8,192)
Writes bench/out/kv_quality_<dtype>.json and prints a table. The measurements are engine/kv_cache/quality.py's;
this script is their command line and report.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine import LLM  # noqa: E402
from engine.kv_cache.quality import (GATES, agreement, corpus_ids, parse_config, passkey,  # noqa: E402
                                     perplexities_decode, perplexity)
from engine.kv_cache.sparse_config import SparseAttentionConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--configs", default="raw,int8,fp8,streaming:0.3,snapkv:0.3,snapkv:0.3+int8",
                    help="comma list: a storage format (raw, int8, fp8, kivi4), or METHOD:BUDGET[+FORMAT] for eviction "
                         "at the end of prefill (snapkv, streaming; budget a share <= 1 or tokens)")
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--score", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--windows", type=int, default=6, help="consecutive windows of text the ppl is measured on")
    ap.add_argument("--lengths", default="1024,2048,4096")
    ap.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--agree-prompts", type=int, default=8)
    ap.add_argument("--agree-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="ppl 1024+256, passkey 1024/2048 x 3 depths x 4 trials")
    ap.add_argument("--only", choices=["ppl", "passkey", "agree"], action="append",
                    help="measure only these (repeatable); default: all three")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.quick:  # (explicit flags still win)
        quick = dict(prefill=1024, score=256, lengths="1024,2048", depths="0.1,0.5,0.9", trials=4, agree_prompts=4,
                     windows=2)
        for key, value in quick.items():
            if getattr(a, key) == ap.get_default(key):
                setattr(a, key, value)
    configs = a.configs.split(",")
    assert configs[0] == "raw", "the first config is the baseline: raw"
    parsed = {name: parse_config(name) for name in configs}
    quest = {n: dataclasses.asdict(SparseAttentionConfig(**p[2])) for n, p in parsed.items() if p[2] is not None}
    if quest and a.chunk != 1:
        print(f"(quest configs: perplexity scored one token per decode step, --chunk 1, for every config; "
              f"--chunk {a.chunk} would read every page)", flush=True)
        a.chunk = 1
    # raw and the quest configs share one engine (sparse attention on, prefix caching on): each request's
    # `sparse_attention` picks its variant ("off" = full KV), and a passkey prompt is prefilled once for all
    # (quest configs of another dense_layers, an engine-wide setting, share an engine of their own)
    by_dense: dict[int, list[str]] = {}
    for n, v in quest.items():
        by_dense.setdefault(v["dense_layers"], []).append(n)
    qgroups = list(by_dense.values()) or [[]]
    groups = [["raw", *qgroups[0]], *qgroups[1:]] + [[n] for n in configs[1:] if n not in quest]
    lengths = [int(x) for x in a.lengths.split(",")]
    depths = [float(x) for x in a.depths.split(",")]
    max_len = max(max(lengths), a.prefill + a.score) + 64
    results, ref_toks = {}, None
    want = set(a.only or ["ppl", "passkey", "agree"])
    for group in groups:
        t0 = time.perf_counter()
        fmt, eviction, _ = parsed[group[0]]
        sparse_engine = next((quest[n] for n in group if n in quest), None)
        variants = {n: quest.get(n, "off") for n in group} if sparse_engine else {group[0]: None}
        pages = max(-(-max_len * 4 // 16), a.windows * -(-(a.prefill + a.score) // 16) + 64)
        llm = LLM(a.model, dtype=a.dtype, kv_storage=fmt, kv_eviction=eviction, num_pages=pages,
                  max_model_len=max_len, max_num_batched_tokens=max(2048, a.prefill),
                  sparse_attention=sparse_engine,
                  enable_prefix_caching=len(variants) > 1)
        span = a.prefill + a.score
        windows = [corpus_ids(llm.tokenizer, span, offset=w * span) for w in range(a.windows)]
        prompts = [corpus_ids(llm.tokenizer, 96, offset=20000 + 500 * i) for i in range(a.agree_prompts)]
        keep = eviction["budget"] if eviction else 1.0  # share of prompt slots kept (what crosses the wire)
        keep = keep / a.prefill if keep > 1 else keep
        rs = {n: {"bytes_per_token_layer": llm.kv_spec.bytes_per_token_layer() * keep, "ppl": None, "passkey": {},
                  "agree": []} for n in variants}
        for name, sparse in variants.items():
            if "ppl" in want:
                rs[name]["ppl"] = (perplexities_decode(llm, windows, a.prefill, sparse) if a.chunk == 1 else
                                   [perplexity(llm, ids, a.prefill, a.chunk) for ids in windows])
                print(f"{name}: ppl {rs[name]['ppl']} [{time.perf_counter() - t0:.0f} s]", flush=True)
        if "passkey" in want:
            cells = passkey(llm, lengths, depths, a.trials, a.seed, variants if len(variants) > 1 else None)
            for name in variants:
                rs[name]["passkey"] = cells[name] if len(variants) > 1 else cells
        if "agree" in want:
            for name, sparse in variants.items():
                ref_toks_new, rs[name]["agree"] = agreement(llm, ref_toks, prompts, a.agree_tokens, sparse)
                ref_toks = ref_toks or ref_toks_new
        for name, r in rs.items():
            r["seconds"] = time.perf_counter() - t0  # (the whole group's: its configs share the engine)
            results[name] = r
            print(f"{name}: ppl {r['ppl']} passkey {r['passkey']} agree {r['agree']} [{r['seconds']:.0f} s]", flush=True)
        assert llm.kv_usage()["pages_in_use"] == 0, llm.kv_usage()
    _report(results, a)


def _report(results: dict, a) -> None:
    base = results["raw"]

    def acc_of(r):
        return sum(r["passkey"].values()) / len(r["passkey"]) if r["passkey"] else float("nan")
    base_acc = acc_of(base)
    print(f"\nKV quality | {a.model} {a.dtype} | ppl: {a.prefill} prefill + {a.score} scored in chunks of {a.chunk}, "
          f"mean of {a.windows} windows (change +- its standard error)")
    print(f"{'config':16} {'ppl':>9} {'change':>8} {'se':>7} {'gate':>6} {'passkey':>8} {'vs raw':>7} "
          f"{'agree mean/min':>15} {'bytes vs raw':>12}")
    for name, r in results.items():
        ppl = statistics.mean(r["ppl"]) if r["ppl"] else float("nan")
        changes = [100 * (p / b - 1) for p, b in zip(r["ppl"], base["ppl"])] if base["ppl"] and r["ppl"] else []
        r["ppl_change_pct"] = changes
        change = statistics.mean(changes) if changes else float("nan")
        se = statistics.stdev(changes) / math.sqrt(len(changes)) if len(changes) > 1 else float("nan")
        gate = GATES.get(name, 1.0 if name.startswith("quest:") else None)
        acc = acc_of(r)
        ok = "" if gate is None or math.isnan(change) else ("PASS" if abs(change) < gate else "FAIL")
        agree = r["agree"] or [0]
        print(f"{name:16} {ppl:9.4f} {change:+7.3f}% +-{se:5.3f} {ok:>6} {acc:8.2f} {acc / max(base_acc, 1e-9):7.2f} "
              f"{sum(agree) / len(agree):9.1f}/{min(agree):<5d} "
              f"{r['bytes_per_token_layer'] / base['bytes_per_token_layer']:11.3f}x")
    _passkey_cells(results)
    out = Path(a.out) if a.out else ROOT / "bench" / "out" / f"kv_quality_{a.dtype}{'_quick' if a.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(a), "results": results}, indent=1))
    print(f"reproduce: .venv/bin/python bench/kv/kv_quality.py {' '.join(sys.argv[1:])}\nwrote {out}")


def _passkey_cells(results: dict) -> None:
    """Passkey accuracy per length@depth cell, each config beside raw (the issue's gate for sparse attention:
    >= 0.95x raw in every cell)."""
    cells = list(results["raw"]["passkey"])
    if not cells:
        return
    names = [n for n, r in results.items() if r["passkey"]]
    print("\npasskey per cell (accuracy; min over cells of config / raw, cells where raw > 0)")
    print(f"{'cell':14}" + "".join(f"{n[:18]:>19}" for n in names))
    for c in cells:
        print(f"{c:14}" + "".join(f"{results[n]['passkey'].get(c, float('nan')):19.2f}" for n in names))
    ratios = []
    for n in names:
        rs = [results[n]["passkey"][c] / results["raw"]["passkey"][c] for c in cells
              if c in results[n]["passkey"] and results["raw"]["passkey"][c] > 0]
        results[n]["passkey_min_ratio"] = min(rs) if rs else None
        ratios.append(f"{min(rs):19.2f}" if rs else f"{'-':>19}")
    print(f"{'min vs raw':14}" + "".join(ratios))


if __name__ == "__main__":
    main()
