"""Decode step time, sparse (Quest) vs full attention, on SmolLM2 bf16, one thread.

    PYTHONPATH=$PWD python bench/sparse_attention_bench.py --contexts 2048 4096 --batches 1 4 --steps 4

For each (context, batch): one engine per mode in the same process (full; sparse with per-KV-head choice on
the torch path; sparse with a per-row choice read in place by the paged kernel; the same choosing in layers
0 and 15 only, the other layers reusing it), requests joined through
`reserve` + `add_prefilled_request` with random post-RoPE-like KV written into their pages (no prefill: this
times the decode step only; the KV's content changes which pages are chosen, not how many), then the mean
of `--steps` decode steps after one warm-up, modes interleaved step by step. Prints each step time and the
ratio to full attention measured in the same round. Quality is `bench/kv_quality.py`'s business.
"""
from __future__ import annotations

import argparse
import time

import torch

from engine import SamplingParams
from engine.llm import LLM

MODES = {"full": None,
         "sparse/kv_head": {"budget": 1024, "sink_pages": 1, "recent": 64},
         "sparse/row": {"budget": 1024, "sink_pages": 1, "recent": 64, "select_per": "row"},
         "row+sel[0,15]": {"budget": 1024, "sink_pages": 1, "recent": 64, "select_per": "row",
                           "selection_layers": [0, 15]}}


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
    a = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{'context':>7} {'batch':>5} " + " ".join(f"{m + ' ms':>16}" for m in MODES)
          + " " + " ".join(f"{m + ' x':>16}" for m in list(MODES)[1:]))
    for ctx in a.contexts:
        for batch in a.batches:
            pages = batch * (-(-(ctx + a.steps + 8) // 16)) + 8
            engines = {m: LLM(model="smollm2-135m", dtype="bfloat16", num_pages=pages, max_model_len=ctx + 64,
                              sparse_attention=cfg) for m, cfg in MODES.items()}
            for llm in engines.values():
                _join(llm, ctx, batch, torch.Generator().manual_seed(ctx + batch))
                llm.step()  # warm-up
            times = {m: [] for m in MODES}
            for _ in range(a.steps):
                for m, llm in engines.items():
                    t0 = time.perf_counter()
                    llm.step()
                    times[m].append(time.perf_counter() - t0)
            ms = {m: 1000 * sum(t) / len(t) for m, t in times.items()}
            print(f"{ctx:>7} {batch:>5} " + " ".join(f"{ms[m]:>16.1f}" for m in MODES) + " "
                  + " ".join(f"{ms[m] / ms['full']:>16.2f}" for m in list(MODES)[1:]), flush=True)
            for llm in engines.values():
                for rid in list(llm.requests):
                    llm.abort(rid)


if __name__ == "__main__":
    main()
