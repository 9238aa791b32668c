"""Attention kernels for bf16 pages on CPU, side by side in one run: the native AVX512-BF16 kernels
(`engine/kernels/cpu/csrc/`) against the paths they replace, as ratios (one thread, SmolLM2's heads: 9 query heads,
3 KV heads, head_dim 64, pages of 16 slots).

  prefill   q_len new queries after `cached` slots, causal (a prefill chunk): native multi-query kernel
            vs SDPA over the pages gathered the way `RawKVBackend` gathers them (gather included)
  decode    batch 16, context ~300, one query per row: native decode kernel vs the numba kernel
            (`engine/kernels/cpu/decode_attention.py`); each call reads the next of `--layers` separate page pools, so
            K/V come from memory as in a real step (one pool would stay in cache)

Order per case: warm-up of both, then native, other, native, other ... `--repeats` times; medians.
Run: .venv/bin/python bench/engine/attention_bench.py [--repeats 15] [--layers 30]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.kernels.cpu import decode_attention as cpu_attention, prefill_attention as cpu_prefill_attention  # noqa: E402,E501
from engine.kernels.cpu.numba_kernels import bits  # noqa: E402

HEADS, KV_HEADS, DIM, PAGE = 9, 3, 64, 16


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def interleave(a, b, repeats: int) -> tuple[float, float]:
    a(), b()
    ta, tb = [], []
    for _ in range(repeats):
        ta.append(timed(a))
        tb.append(timed(b))
    return statistics.median(ta), statistics.median(tb)


def pools(num_pages: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_pages, PAGE, KV_HEADS, DIM)
    return (torch.randn(shape, generator=gen).to(torch.bfloat16), torch.randn(shape, generator=gen).to(torch.bfloat16))


def prefill_case(q_len: int, cached: int, repeats: int, gen: torch.Generator) -> tuple[float, float]:
    n = cached + q_len
    k_pool, v_pool = pools(4 * (-(-n // PAGE)) + 1, gen)
    table = torch.randperm(k_pool.shape[0] - 1, generator=gen)[: -(-n // PAGE)] + 1  # scattered pages
    page_index = table.view(1, -1).numpy().astype(np.int64)
    q = torch.randn(q_len, HEADS, DIM, generator=gen).to(torch.bfloat16)
    lens = np.array([n], dtype=np.int64)
    seen = torch.arange(n)[None, :] <= cached + torch.arange(q_len)[:, None]
    bias = torch.zeros((), dtype=torch.bfloat16).masked_fill(~seen, float("-inf"))[None, None]

    def sdpa():
        k = k_pool.index_select(0, table).view(1, -1, KV_HEADS, DIM)[:, :n].transpose(1, 2)
        v = v_pool.index_select(0, table).view(1, -1, KV_HEADS, DIM)[:, :n].transpose(1, 2)
        qh = q.view(1, q_len, HEADS, DIM).transpose(1, 2)
        if cached == 0:
            return F.scaled_dot_product_attention(qh, k, v, is_causal=True, enable_gqa=True)
        return F.scaled_dot_product_attention(qh, k, v, attn_mask=bias, enable_gqa=True)

    native = lambda: cpu_prefill_attention.prefill_attention_bf16(q, k_pool, v_pool, page_index, lens, q_len, 0.125)  # noqa: E731
    return interleave(native, sdpa, repeats)


def decode_case(batch: int, ctx: int, layers: int, repeats: int, gen: torch.Generator) -> tuple[float, float]:
    per_row = -(-(ctx + 32) // PAGE)
    num_pages = batch * per_row + 1
    layer_pools = [tuple(bits(t) for t in pools(num_pages, gen)) for _ in range(layers)]
    page_index = (torch.randperm(num_pages - 1, generator=gen)[: batch * per_row] + 1).view(batch, per_row)
    page_index = page_index.numpy().astype(np.int64)
    lens = np.array([ctx - 8 + (i * 7) % 17 for i in range(batch)], dtype=np.int64)  # ragged, as in a batch
    q = bits(torch.randn(batch, HEADS, DIM, generator=gen).to(torch.bfloat16))
    lib = cpu_attention.native_library

    def run(native: bool):
        def step():  # one call per "layer", each on its own pools
            cpu_attention.native_library = lib if native else (lambda: None)
            try:
                for kp, vp in layer_pools:
                    cpu_attention.attend_decode_bf16(q, kp, vp, page_index, lens, 0.125)
            finally:
                cpu_attention.native_library = lib
        return step

    a, b = interleave(run(True), run(False), repeats)
    return a / layers, b / layers


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--layers", type=int, default=30, help="separate page pools the decode case cycles through")
    args = p.parse_args(argv)
    if not (cpu_prefill_attention.available() and cpu_attention.native_library() is not None):
        print("native kernels unavailable here (no C compiler or no AVX512-BF16): nothing to compare")
        return 1
    gen = torch.Generator().manual_seed(0)
    print(f"bf16 attention, 1 thread, {HEADS}/{KV_HEADS} heads x {DIM}, pages of {PAGE} | repeats {args.repeats}")
    rows = [("case", "native ms", "reference ms", "ratio")]
    for q_len, cached in ((512, 0), (128, 0), (256, 256), (128, 384), (16, 300), (4, 300)):
        a, b = prefill_case(q_len, cached, args.repeats, gen)
        rows.append((f"prefill q_len {q_len} after {cached} (vs SDPA)", f"{a:.3f}", f"{b:.3f}", f"{a / b:.2f}x"))
    for batch, ctx in ((16, 300), (4, 300), (2, 300)):  # one row takes numba (cpu_attention.NATIVE_MIN_ROWS)
        a, b = decode_case(batch, ctx, args.layers, args.repeats, gen)
        rows.append((f"decode {batch} x ~{ctx}, a layer (vs numba)", f"{a:.3f}", f"{b:.3f}", f"{a / b:.2f}x"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    print(f"reproduce: .venv/bin/python bench/engine/attention_bench.py --repeats {args.repeats} --layers {args.layers}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
