"""What sampling costs a decode step, per batch size, side by side in one run (issue 32): the device sampler
(engine/device_sampler.py) eagerly and replayed from its CUDA graphs (with the sort: top-p 0.95; without:
temperature alone), the greedy argmax, and the CPU sampler on a host copy of the logits (the path before).
Logits are random [B, vocab] float32 on the device (the bucket's own); temperature 0.8, seeded rows.

Run:  python bench/gpu/sampler_cost.py --vocab 128256 --batches 1,16,64,128 --out DIR
      (CPU, tiny: --device cpu --vocab 4096 --batches 1,4 --reps 2)
Writes DIR/sampler_cost.json and prints a markdown table (ms per step; ratios to the greedy argmax).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.device_sampler import pack_params, sample_rows  # noqa: E402
from engine.kernels.cuda.graph_sampling import StaticSampler  # noqa: E402
from engine.sampler import SampleRequest, sample_batch  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


def timed(fn, device: str, reps: int) -> float:
    """Median ms of `fn()` over `reps` calls after two warm-ups, synchronised around each."""
    cuda = device.startswith("cuda")
    out = []
    for i in range(reps + 2):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        if i >= 2:
            out.append((time.perf_counter() - t) * 1e3)
    return round(statistics.median(out), 3)


def measure(b: int, vocab: int, device: str, reps: int, host_reps: int) -> dict:
    logits = torch.randn(b, vocab, device=device) * 3
    params = {"top_p": SamplingParams(temperature=0.8, top_p=0.95), "temp": SamplingParams(temperature=0.8)}
    row = {"batch": b, "vocab": vocab, "greedy_ms": timed(lambda: torch.max(logits, -1).indices, device, reps)}
    sampler = StaticSampler(b, torch.device(device), pin=device.startswith("cuda"))
    for name, p in params.items():
        reqs = [SampleRequest(p, 1000 + i, 3, [], []) for i in range(b)]
        dev = torch.from_numpy(pack_params(reqs)).to(device)
        row[f"{name}_eager_ms"] = timed(lambda: sample_rows(logits, dev, name == "top_p"), device, reps)
        sampler.fill(reqs)
        sampler.upload()
        if name == "top_p" and device.startswith("cuda"):
            sampler.capture(logits, None)
        if sampler.graphs:
            row[f"{name}_graph_ms"] = timed(lambda: sampler.run(logits, name == "top_p"), device, reps)
        if host_reps:
            row[f"{name}_host_ms"] = timed(lambda: sample_batch(logits.cpu(), reqs), device, host_reps)
    for k in [k for k in row if k.endswith("_ms") and k != "greedy_ms"]:
        row[k.replace("_ms", "_x")] = round(row[k] / row["greedy_ms"], 2)
    print(json.dumps(row), flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--batches", default="1,16,64,128")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--host-reps", type=int, default=2, help="reps of the CPU sampler (0: skip it)")
    ap.add_argument("--host-max-batch", type=int, default=16, help="the CPU sampler only up to this batch")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    rows = [measure(int(b), a.vocab, a.device, a.reps, a.host_reps if int(b) <= a.host_max_batch else 0)
            for b in a.batches.split(",")]
    gpu = torch.cuda.get_device_name() if a.device.startswith("cuda") else a.device
    (a.out / "sampler_cost.json").write_text(json.dumps({"device": gpu, "torch": torch.__version__, "rows": rows},
                                                        indent=1))
    cols = ["greedy", "top_p_eager", "top_p_graph", "temp_eager", "temp_graph", "top_p_host", "temp_host"]
    print(f"sampling one step, vocab {a.vocab}, on {gpu} (ms; x greedy argmax)")
    print("| batch | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for r in rows:
        cells = [f"{r[c + '_ms']} ({r.get(c + '_x', 1.0)}x)" if c + "_ms" in r else "" for c in cols]
        print(f"| {r['batch']} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
