"""Prefill and decode step time and GPU power on CUDA, through pdserve's own engine (issue 26's device check).

What it measures, per model: one prefill step of N prompt tokens (one request, the step's token budget = N)
and one decode step of B running requests at a context of about L tokens, each repeated for --seconds of
wall time after a warm-up; the step's median time, and the GPU's power over the repeats from `nvidia-smi
-lms 100` (power.draw, the driver's 1 s average, and power.draw.instant where the driver has it), SM clock
and utilization, plus the idle power before anything runs. `bench/gpu/step_compare.py` (CPU, pure Python)
then puts these beside the planner's GPU step model and `deploy/hardware.yaml`'s power.

Models: `smollm2-135m` (or any name `LLM` takes) with its real weights, or `random:<deploy/models name>`:
that model's shapes (config from deploy/models/*.yaml) with random bfloat16 weights made on the GPU as the
engine asks for each tensor (no checkpoint on disk: an 8B model's 16 GB never leave the device).

Run:  python bench/gpu/step_power.py --model random:llama-3-8b --out DIR [--seconds 4]
Writes DIR/steps_<model>.json (and .csv of the raw power samples).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cluster.planner.calibrate.random_model import RandomWeights, random_model_dir  # noqa: E402,F401 (gpu_decode_floor imports them here)
from engine import LLM, SamplingParams  # noqa: E402

FIELDS = ("power.draw", "power.draw.instant", "clocks.sm", "utilization.gpu", "temperature.gpu")


class PowerSampler:
    """`nvidia-smi --query-gpu=... -lms 100` in the background; samples stamped with time.monotonic()."""

    def __init__(self, period_ms: int = 100):
        fields = list(FIELDS)
        probe = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True)
        if probe.returncode != 0:  # an older driver without power.draw.instant
            fields.remove("power.draw.instant")
        self.fields = fields
        self.samples: list[tuple[float, list[float | None]]] = []
        self.proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits",
                                      f"-lms={period_ms}"], stdout=subprocess.PIPE, text=True, bufsize=1)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            vals = []
            for v in line.strip().split(","):
                try:
                    vals.append(float(v))
                except ValueError:
                    vals.append(None)
            self.samples.append((time.monotonic(), vals))

    def window(self, t0: float, t1: float) -> dict:
        rows = [v for t, v in self.samples if t0 <= t <= t1]
        out = {"n_samples": len(rows)}
        for i, name in enumerate(self.fields):
            col = [r[i] for r in rows if i < len(r) and r[i] is not None]
            out[name] = round(statistics.mean(col), 1) if col else None
            if name.startswith("power") and col:
                out[name + ".max"] = round(max(col), 1)
        return out

    def stop(self) -> None:
        self.proc.terminate()


def make_llm(model: str, device: str, dtype: str, num_pages: int, tmp: Path) -> LLM:
    kw = dict(dtype=dtype, device=device, num_pages=num_pages, max_num_seqs=256, max_num_batched_tokens=8192,
              num_threads=None)
    if not model.startswith("random:"):
        return LLM(model=model, **kw)
    import engine.llm as engine_llm

    model_dir, shapes = random_model_dir(model.split(":", 1)[1], tmp / "model")
    real = engine_llm.load_weights
    engine_llm.load_weights = lambda _dir: RandomWeights(shapes, device, getattr(torch, dtype))
    try:
        return LLM(model=str(model_dir), **kw)
    finally:
        engine_llm.load_weights = real


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_loop(seconds: float, one) -> list[float]:
    """Call one() (returns the seconds of the step it timed) until `seconds` of wall time have passed."""
    times, t_end = [], time.monotonic() + seconds
    while time.monotonic() < t_end or len(times) < 3:
        times.append(one())
    return times


def prefill_case(llm: LLM, device: str, n: int, seconds: float, vocab: int) -> tuple[list[float], float, float]:
    llm.scheduler.cfg = replace(llm.scheduler.cfg, max_num_batched_tokens=n)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(n)

    def one() -> float:
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()  # fresh prompt: no cache can help
        llm.add_request(ids, params)
        sync(device)
        t = time.perf_counter()
        llm.step()
        sync(device)
        dt = time.perf_counter() - t
        llm.generate_until_idle()  # nothing left in practice: max_tokens 1 finishes in the prefill step
        return dt

    one()  # warm-up
    t0 = time.monotonic()
    times = timed_loop(seconds, one)
    return times, t0, time.monotonic()


def decode_case(llm: LLM, device: str, batch: int, context: int, seconds: float, vocab: int
                ) -> tuple[list[float], float, float]:
    llm.scheduler.cfg = replace(llm.scheduler.cfg, max_num_batched_tokens=8192)
    pool = llm.allocator.num_pages * llm.kv_spec.page_size
    cap = min(2048, llm.max_model_len - context, pool - context)  # the timed loop ends long before
    params = SamplingParams(max_tokens=cap, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(batch)
    rids = [llm.add_request(torch.randint(3, vocab, (context,), generator=g).tolist(), params) for _ in range(batch)]
    while any(llm.requests[r].num_computed < context for r in rids if r in llm.requests):
        llm.step()  # prefill every prompt first

    def one() -> float:
        sync(device)
        t = time.perf_counter()
        llm.step()
        sync(device)
        return time.perf_counter() - t

    for _ in range(3):
        one()
    t0 = time.monotonic()
    times = timed_loop(seconds, one)
    t1 = time.monotonic()
    for r in rids:
        llm.abort(r)
    return times, t0, t1


def profile_decode(llm: LLM, device: str, batch: int, context: int, seconds: float, vocab: int) -> int:
    import cProfile
    import pstats

    prof = cProfile.Profile()
    real_step = llm.step

    def step():
        prof.enable()
        try:
            return real_step()
        finally:
            prof.disable()

    decode_case(llm, device, batch, context, 1.0, vocab)  # warm-up, unprofiled
    llm.step = step
    times = decode_case(llm, device, batch, context, seconds, vocab)[0]
    print(f"decode batch {batch}: {len(times)} steps, median {statistics.median(times) * 1e3:.2f} ms")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prefill", default="512,2048,8064", help="prompt tokens per prefill step")
    ap.add_argument("--decode", default="1,16,64,128", help="running requests per decode step")
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens of each decoding request")
    ap.add_argument("--seconds", type=float, default=4.0, help="wall time per case (power needs >= 2 s)")
    ap.add_argument("--num-pages", type=int, default=12288)
    ap.add_argument("--profile", type=int, default=0, metavar="B",
                    help="instead: cProfile decode steps at batch B and print where the host's time goes")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    cuda = a.device.startswith("cuda")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    sampler = PowerSampler() if cuda else None
    result: dict = {"model": a.model, "device": a.device, "dtype": a.dtype, "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name() if cuda else None, "context": a.context, "cases": []}
    if sampler:
        time.sleep(2.5)
        result["idle"] = sampler.window(time.monotonic() - 2.0, time.monotonic())
    with tempfile.TemporaryDirectory() as tmp:
        t = time.monotonic()
        llm = make_llm(a.model, a.device, a.dtype, a.num_pages, Path(tmp))
        result["load_s"] = round(time.monotonic() - t, 1)
        vocab = llm.config.vocab_size
        if a.profile:
            return profile_decode(llm, a.device, a.profile, a.context, a.seconds, vocab)
        cases = [("prefill", int(n)) for n in a.prefill.split(",") if n] + \
                [("decode", int(b)) for b in a.decode.split(",") if b]
        for phase, size in cases:
            if phase == "prefill":
                times, t0, t1 = prefill_case(llm, a.device, size, a.seconds, vocab)
            else:
                times, t0, t1 = decode_case(llm, a.device, size, a.context, a.seconds, vocab)
            med = statistics.median(times)
            row = {"phase": phase, "size": size, "steps": len(times), "median_ms": round(med * 1e3, 3),
                   "p10_ms": round(sorted(times)[len(times) // 10] * 1e3, 3),
                   "tokens_per_s": round(size / med, 1)}
            if sampler:  # skip the first 1.5 s: power.draw is a 1 s average that lags the load
                row["power"] = sampler.window(min(t0 + 1.5, t1 - 0.5), t1)
            result["cases"].append(row)
            print(json.dumps(row), flush=True)
        del llm
    tag = Path(a.model.replace(":", "_")).name
    if sampler:
        sampler.stop()
        with open(a.out / f"power_{tag}.csv", "w") as f:
            f.write("t," + ",".join(sampler.fields) + "\n")
            for ts, vals in sampler.samples:
                f.write(f"{ts:.3f}," + ",".join("" if v is None else str(v) for v in vals) + "\n")
    (a.out / f"steps_{tag}.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
