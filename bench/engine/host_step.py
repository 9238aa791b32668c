"""The host's share of a decode step, alone (issue 32): everything `LLM.step()` does on the CPU around a
static-shape (CUDA-graph) decode step -- scheduling, the batch, the inputs, sampling's bookkeeping,
detokenizing, outputs -- with the step's device work replaced by fixed logits. On a GPU this is what must fit
under the GPU's own step time (bench/gpu_results/2026-11-27/run4: SmolLM2 at batch 64, GPU 1.59 ms, host
not overlapped 1.46 ms); here it is measured on one CPU core, where a change to the host path shows at once.

Run:  python bench/engine/host_step.py [--batch 64] [--steps 60] [--profile]
Prints the median host time per step and per row (the real SmolLM2 tokenizer; greedy rows; the first
`--prompt` tokens prefilled with the real model once).
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=8)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--profile", action="store_true", help="also cProfile the timed steps (top 20 by own time)")
    a = ap.parse_args(argv)
    os.environ.setdefault("PDSERVE_ATTENTION", "triton")  # the static step needs the Triton page layout
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (never run here: the forward is replaced)
    import torch

    from engine import LLM, SamplingParams

    llm = LLM(model=a.model, dtype="float32", max_num_seqs=a.batch, max_num_batched_tokens=max(256, a.batch),
              decode_graphs="static", num_pages=a.batch * (-(-(a.prompt + 4 * a.steps + 64) // 16)) + 8)
    graphs = llm.decode_graphs
    g = torch.Generator().manual_seed(0)
    vocab = llm.config.vocab_size
    logits = torch.randn(a.batch * max(1, graphs.verify_len), vocab, generator=g)
    graphs._forward = lambda bk: logits[:bk.rows * bk.qlen]  # the device's work, stubbed: fixed logits
    params = SamplingParams(max_tokens=4 * a.steps + 32, temperature=0.0, ignore_eos=True)
    for _ in range(a.batch):
        llm.add_request(torch.randint(100, vocab, (a.prompt,), generator=g).tolist(), params)
    llm.backend.triton_paged = False  # the prompts through the real model on the CPU path (not interpreted)
    while any(r.num_computed < a.prompt for r in llm.requests.values()):
        llm.step()
    llm.backend.triton_paged = True
    for _ in range(5):
        llm.step()
    times = []
    prof = cProfile.Profile() if a.profile else None
    for _ in range(a.steps):
        t = time.perf_counter()
        if prof:
            prof.enable()
        llm.step()
        if prof:
            prof.disable()
        times.append(time.perf_counter() - t)
    argmax = []  # the device's share of sampling (the greedy argmax runs on the GPU there): timed, left out
    for _ in range(10):
        t = time.perf_counter()
        torch.max(logits[:a.batch], dim=-1)
        argmax.append(time.perf_counter() - t)
    med = statistics.median(times) - statistics.median(argmax)
    print(f"{a.model}, batch {a.batch}: host {med * 1e3:.3f} ms a step, {med / a.batch * 1e6:.1f} us a row "
          f"(median of {a.steps}; device work stubbed, the argmax's {statistics.median(argmax) * 1e3:.2f} ms "
          f"left out)")
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)
    for rid in list(llm.requests):
        llm.abort(rid)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
