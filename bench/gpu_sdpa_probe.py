"""Where a CUDA decode step's attention time goes: one SDPA call per layer at decode shapes, as the engine
made it before and after folding GQA (issue 26's device check found 1 ms of host time per call).

Shapes: one query per row, B rows, the KV of each row `ctx` slots growing by one per step (as in decode),
30 calls per step (one per layer). Variants:
  gqa      q [B, Hq, 1, d] with enable_gqa=True (the engine before)
  fold     q as [B, Hkv, Hq/Hkv, d] per KV head, no enable_gqa (the engine after)
  fold:<backend>  fold with one SDPA backend forced (flash, efficient, math, cudnn), or a list a+b+c
                  (what engine/sdpa_backends.py names)
Prints microseconds per call (wall, synchronised per step; nan where a forced backend refuses the shape).

Run:  python bench/gpu_sdpa_probe.py [--steps 40]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "math": SDPBackend.MATH, "cudnn": SDPBackend.CUDNN_ATTENTION}


def run(variant: str, b: int, hq: int, hkv: int, d: int, ctx0: int, steps: int, layers: int = 30) -> float:
    dev, dt = "cuda", torch.bfloat16
    pool_k = torch.randn(b, ctx0 + steps + 1, hkv, d, device=dev, dtype=dt)
    pool_v = torch.randn_like(pool_k)
    q = torch.randn(b, hq, d, device=dev, dtype=dt)
    name, _, backend = variant.partition(":")

    def call(ctx: int) -> torch.Tensor:
        kh, vh = pool_k[:, :ctx].transpose(1, 2), pool_v[:, :ctx].transpose(1, 2)
        if name == "gqa":
            return F.scaled_dot_product_attention(q.view(b, 1, hq, d).transpose(1, 2), kh, vh, enable_gqa=True)
        return F.scaled_dot_product_attention(q.view(b, hkv, hq // hkv, d), kh, vh)

    def step(ctx: int) -> None:
        for _ in range(layers):
            call(ctx)

    ctxmgr = sdpa_kernel([BACKENDS[x] for x in backend.split("+")]) if backend else None
    try:
        if ctxmgr:
            ctxmgr.__enter__()
        step(ctx0)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for i in range(steps):
            step(ctx0 + 1 + i)
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / (steps * layers) * 1e6
    except RuntimeError as e:  # the forced backend refuses the shape: nan in the table
        print(f"  ({variant}, B={b}, {hq}/{hkv}x{d}: {str(e).splitlines()[0][:100]})")
        return float("nan")
    finally:
        if ctxmgr:
            ctxmgr.__exit__(None, None, None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    a = ap.parse_args(argv)
    print(torch.__version__, torch.cuda.get_device_name())
    shapes = [("smollm2", 1, 9, 3, 64), ("smollm2", 64, 9, 3, 64), ("llama-3-8b", 1, 32, 8, 128),
              ("llama-3-8b", 64, 32, 8, 128)]
    variants = ["gqa", "fold"] + [f"fold:{k}" for k in BACKENDS] + ["fold:flash+efficient+math",
                                                                    "gqa:flash+efficient+math",
                                                                    "fold:cudnn+flash+efficient+math"]
    print("us per call; columns: " + ", ".join(f"{i}={v}" for i, v in enumerate(variants)))
    print("model       B    " + "".join(f"{i:>9}" for i in range(len(variants))))
    for model, b, hq, hkv, d in shapes:
        row = [run(v, b, hq, hkv, d, 1024, a.steps) for v in variants]
        print(f"{model:<11} {b:<4} " + "".join(f"{x:9.1f}" for x in row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
