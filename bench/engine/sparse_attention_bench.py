"""Decode step time, sparse (Quest) vs full attention, on SmolLM2 bf16, one thread.

    .venv/bin/python bench/engine/sparse_attention_bench.py --contexts 8128 --batches 8 --steps 6

For each (context, batch): one engine per mode in the same process (full; the default config, a choice per
KV head; a per-row choice; the same choosing in layers 0 and 15 only, the other layers reusing it; bf16
pages on CPU read the chosen pages in place through the paged kernel in every sparse mode), requests
joined through `reserve` + `add_prefilled_request` with random post-RoPE-like KV written into their
pages (no prefill: this times the decode step only; the KV's content changes which pages are chosen, not
how many), then `--steps` decode steps after one warm-up, modes interleaved step by step. Prints each
mode's mean step time (wall clock) and its ratio to full attention measured in the same round, then the
same from the thread's CPU time (steadier on a shared machine: time the process waited for a core is not
counted), and the median wall-clock ratio of the per-step pairs. `--modes` picks a subset (full always
runs). SmolLM2's context is 8192 tokens: "8k" here is 8128 (+ the generated tokens).
Quality is `bench/kv/kv_quality.py`'s business.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain script folder: make `engine` importable without an install
    sys.path.insert(0, str(ROOT))

from engine import SamplingParams  # noqa: E402
from engine.llm import LLM  # noqa: E402

MODES = {"full": None,
         "default": {"method": "quest", "budget": 1024},  # SparseAttentionConfig's defaults: per KV head
         "row": {"method": "quest", "budget": 1024, "select_per": "row"},
         "row+sel[0,15]": {"method": "quest", "budget": 1024, "select_per": "row", "selection_layers": [0, 15]},
         "kv_head+sel[0,15]": {"method": "quest", "budget": 1024, "selection_layers": [0, 15]}}


def _join(llm: LLM, ctx: int, batch: int, gen: torch.Generator) -> None:
    spec = llm.kv_spec
    for b in range(batch):
        prompt = [int(t) for t in torch.randint(10, 1000, (ctx,), generator=gen)]
        res = llm.reserve(ctx)
        ps = spec.page_size
        slots = torch.tensor([res.pages[t // ps] * ps + t % ps for t in range(ctx)])
        for layer in spec.local_layers:
            k = torch.randn(ctx, spec.num_kv_heads, spec.head_dim, generator=gen)
            k[:, :, : spec.head_dim // 8] *= 6  # a few outlier channels, as post-RoPE keys have
            v = torch.randn(ctx, spec.num_kv_heads, spec.head_dim, generator=gen)
            llm.backend.write(layer, slots, k, v)
        llm.add_prefilled_request(prompt, 42, res.reservation_id,
                                  SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--modes", nargs="+", default=list(MODES)[1:], choices=list(MODES)[1:])
    a = ap.parse_args()
    torch.set_num_threads(1)
    modes = ["full", *a.modes]
    for ctx in a.contexts:
        for batch in a.batches:
            pages = batch * (-(-(ctx + a.steps + 8) // 16)) + 8
            engines = {m: LLM(model="smollm2-135m", dtype="bfloat16", num_pages=pages, max_model_len=min(ctx + 64, 8192),
                              sparse_attention=MODES[m]) for m in modes}
            for llm in engines.values():
                _join(llm, ctx, batch, torch.Generator().manual_seed(ctx + batch))
                llm.step()  # warm-up
            wall, cpu = ({m: [] for m in modes} for _ in range(2))
            for _ in range(a.steps):
                for m, llm in engines.items():
                    t0, c0 = time.perf_counter(), time.thread_time()
                    llm.step()
                    wall[m].append(time.perf_counter() - t0)
                    cpu[m].append(time.thread_time() - c0)
            print(f"context {ctx} x {batch} rows, {a.steps} steps")
            print(f"  {'mode':<18} {'wall ms':>9} {'x full':>7} {'cpu ms':>9} {'x full':>7} {'median x':>9}  wall ms per step")
            for m in modes:
                w, c = (1000 * sum(t[m]) / len(t[m]) for t in (wall, cpu))
                wf, cf = (1000 * sum(t["full"]) / len(t["full"]) for t in (wall, cpu))
                med = statistics.median(x / y for x, y in zip(wall[m], wall["full"]))
                steps = " ".join(f"{1000 * x:.0f}" for x in wall[m])
                print(f"  {m:<18} {w:>9.1f} {w / wf:>7.2f} {c:>9.1f} {c / cf:>7.2f} {med:>9.2f}  {steps}", flush=True)
            for llm in engines.values():
                for rid in list(llm.requests):
                    llm.abort(rid)
            del engines


if __name__ == "__main__":
    main()
