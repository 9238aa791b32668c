"""The Triton paged kernel alone on int8 cells vs bf16 pages (issue 32's int8 row): is the int8 step's cost in
the kernel, and does the cell's width (its alignment) decide it?

One decode batch at Llama-3-8B's attention shape (32 query heads, 8 KV heads, head_dim 128, 16-token pages),
one layer's pools, the kernel timed with CUDA events (median of 30): bf16 pages, int8 cells as stored today
(head_dim + 2 bytes: values, then a float16 scale), and the same cells padded to head_dim + 16 bytes (every
cell 16-byte aligned). Prints ms per call and the K/V bytes read per second.

Run:  python bench/gpu/int8_cells.py [--batch 128] [--context 2048]      (CPU: --device cpu, tiny, interpreted)
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.kernels.cuda.paged_attention import num_splits, paged_attention  # noqa: E402
from engine.kernels.reference import paged_attention as reference  # noqa: E402


def _time(fn, device: str, reps: int) -> float:
    times = []
    for _ in range(reps + 3):
        if device == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times[3:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head dim")
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args(argv)
    hq, hkv, d = (int(x) for x in a.heads.split(","))
    ps, dev = 16, a.device
    per_row = -(-a.context // ps)
    pages = a.batch * per_row + 1
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(a.batch, hq, d, device=dev, generator=g).bfloat16()
    table = torch.randperm(pages - 1, device=dev, generator=g)[:a.batch * per_row].view(a.batch, per_row)
    lens = torch.full((a.batch,), a.context, dtype=torch.int32, device=dev)
    splits = num_splits(a.batch, hkv, a.context, torch.cuda.get_device_properties(0).multi_processor_count
                        if dev == "cuda" else 4)
    k = torch.randn(pages, ps, hkv, d, device=dev, generator=g).bfloat16()
    v = torch.randn(pages, ps, hkv, d, device=dev, generator=g).bfloat16()
    scale = d ** -0.5
    rows = []
    bf16_out = paged_attention(q, k, v, table, lens, scale, 1, splits)
    rows.append(("bf16 pages", _time(lambda: paged_attention(q, k, v, table, lens, scale, 1, splits), dev, a.reps),
                 2 * a.batch * a.context * hkv * d * 2))
    for width in (d + 2, d + 16):
        cells = []
        for x in (k, v):  # int8 values and a float16 scale per (token, head), padded to `width` bytes
            s = (x.float().abs().amax(-1, keepdim=True) / 127).clamp_min(2 ** -14).half()
            c = torch.zeros(*x.shape[:-1], width, dtype=torch.uint8, device=dev)
            c[..., :d] = (x.float() / s.float()).round().clamp(-127, 127).to(torch.int8).view(torch.uint8)
            c[..., d:d + 2] = s.view(torch.uint8)
            cells.append(c)
        kc, vc = cells
        out = paged_attention(q, kc, vc, table, lens, scale, 1, splits)
        err = (out.float() - bf16_out.float()).abs().max().item()
        t = _time(lambda: paged_attention(q, kc, vc, table, lens, scale, 1, splits), dev, a.reps)
        rows.append((f"int8 cells of {width} bytes (max |diff| vs bf16 {err:.3f})", t, 2 * a.batch * a.context * hkv * width))
    if dev != "cuda":  # a correctness anchor for the CPU dry run
        want = reference(q.float(), k.float(), v.float(), table, lens, scale).bfloat16()
        print(f"bf16 kernel vs reference max |diff| {(bf16_out.float() - want.float()).abs().max().item():.4f}")
    print(f"batch {a.batch}, context {a.context}, heads {hq}/{hkv} x {d}, splits {splits}, device {dev}")
    for name, t, nbytes in rows:
        print(f"  {name}: {t * 1e3:.3f} ms, {nbytes / t / 1e9:.0f} GB/s of K/V")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
