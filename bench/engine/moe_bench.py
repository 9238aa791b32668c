"""The MoE layer's grouped path against the per-token reference (engine/moe.py), side by side in one run:
bf16 on CPU, one thread, tiny widths (hidden 256, experts of 128 by default), random router and experts.

  grouped    the step's (token, expert) assignments sorted by expert: one GEMM per active expert, so an
             expert's weights are read once per step however many of the batch's tokens chose it (bf16 on
             CPU, experts this small: the whole step in one numba call, engine/kernels/cpu/moe_experts.py)
  per_token  each token's k experts one row at a time: an expert's weights read once per assignment

Per case (experts x top-k x batch) each timed call runs a batch through `--layers` MoE layers with separate
weights (so weights come from memory, not from the cache a single layer would stay in); times are per
layer, the thread's CPU time (robust to other processes on this shared machine; the ratio is of these) and
wall clock. Order: warm-up of both, then grouped, per-token, grouped, ... `--repeats` times; medians. The weight
bytes read per layer per step: per-token = assignments x one expert's bytes, grouped = distinct experts
chosen x one expert's bytes (router weights, the same for both, left out); "bound" is their ratio, the
grouped/per-token time ratio that reading weights alone allows (when both are bound by the weight reads).
Targets (issue 35): grouped <= 0.5x per-token at batch 16, <= 1x at batch 1. The "bound" only binds where
per-token is limited by its weight reads; at these widths it is limited by ops per assignment (~50 us each),
so grouped can fall below it (64 experts top-2, batch 16: ~0.35x against a bound of 0.77x).
Run: .venv/bin/python bench/engine/moe_bench.py [--experts 8,16,64] [--top-k 2,8] [--batches 1,2,4,16,64]
Results: docs/engine.md (the MoE paragraph).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.config import MoEConfig  # noqa: E402
from engine.moe import load_moe_layer, moe_forward, route  # noqa: E402


def make_layers(experts: int, top_k: int, hidden: int, inter: int, count: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    cfg = MoEConfig(experts, top_k, inter, True, (0,), True, "qwen")
    layers = []
    for _ in range(count):
        w = {"p.mlp.gate.weight": torch.randn(experts, hidden, generator=g) * 0.1,
             "p.mlp.experts.gate_up_proj": torch.randn(experts, 2 * inter, hidden, generator=g) * 0.05,
             "p.mlp.experts.down_proj": torch.randn(experts, hidden, inter, generator=g) * 0.05}
        layers.append(load_moe_layer(cfg, w, lambda n: w[n].to(torch.bfloat16).contiguous(), "p."))
    return layers


def time_ms(layers, h, impl: str) -> tuple[float, float]:
    """(thread CPU ms, wall ms) per layer."""
    c0, t0 = time.thread_time(), time.perf_counter()
    for layer in layers:
        moe_forward(layer, h, impl)
    return (time.thread_time() - c0) * 1e3 / len(layers), (time.perf_counter() - t0) * 1e3 / len(layers)


def case(experts: int, top_k: int, batch: int, args) -> dict:
    layers = make_layers(experts, top_k, args.hidden, args.inter, args.layers, seed=experts * 100 + top_k)
    h = (torch.randn(batch, args.hidden, generator=torch.Generator().manual_seed(batch))).to(torch.bfloat16)
    for impl in ("grouped", "per_token"):
        time_ms(layers, h, impl)  # warm-up (numba GEMV compiled once, oneDNN primitives created)
    grouped, per_token = [], []
    for _ in range(args.repeats):
        grouped.append(time_ms(layers, h, "grouped"))
        per_token.append(time_ms(layers, h, "per_token"))
    one = layers[0].expert_bytes()
    distinct = statistics.mean(len(set(route(layer, h)[1].flatten().tolist())) for layer in layers)
    g, p = (statistics.median(x[0] for x in grouped), statistics.median(x[0] for x in per_token))
    gw, pw = (statistics.median(x[1] for x in grouped), statistics.median(x[1] for x in per_token))
    return {"experts": experts, "top_k": top_k, "batch": batch, "grouped_ms": g, "per_token_ms": p,
            "ratio": g / p, "grouped_wall_ms": gw, "per_token_wall_ms": pw, "wall_ratio": gw / pw,
            "grouped_MB": distinct * one / 1e6, "per_token_MB": batch * top_k * one / 1e6, "distinct_experts": distinct,
            "bytes_bound": distinct / (batch * top_k)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap.add_argument("--experts", type=ints, default=[8, 16, 64])
    ap.add_argument("--top-k", type=ints, default=[2, 8])
    ap.add_argument("--batches", type=ints, default=[1, 2, 4, 16, 64])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--inter", type=int, default=128, help="each expert's intermediate size")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    print(f"bf16, 1 thread, hidden {args.hidden}, expert intermediate {args.inter}, {args.layers} layers per call, "
          f"medians of {args.repeats}; thread CPU ms (wall ms) and MB per layer per step")
    print(f"{'experts':>7} {'top_k':>5} {'batch':>5} {'grouped ms':>16} {'per-token ms':>16} {'ratio':>6} "
          f"{'wall':>6} {'grouped MB':>10} {'per-token MB':>12} {'distinct':>8} {'bound':>6}")
    rows = []
    for experts in args.experts:
        for top_k in (k for k in args.top_k if k <= experts):
            for batch in args.batches:
                r = case(experts, top_k, batch, args)
                rows.append(r)
                g = f"{r['grouped_ms']:.3f} ({r['grouped_wall_ms']:.3f})"
                p = f"{r['per_token_ms']:.3f} ({r['per_token_wall_ms']:.3f})"
                print(f"{experts:>7} {top_k:>5} {batch:>5} {g:>16} {p:>16} {r['ratio']:>5.2f}x "
                      f"{r['wall_ratio']:>5.2f}x "
                      f"{r['grouped_MB']:>10.2f} {r['per_token_MB']:>12.2f} {r['distinct_experts']:>8.1f} "
                      f"{r['bytes_bound']:>5.2f}x", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
