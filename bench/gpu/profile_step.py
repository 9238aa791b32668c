"""torch.profiler over a few decode steps at one batch size, per engine path: where a step's GPU and host time
go (issue 32's device check; bench/gpu/decode_floor.py has the step times against the floor).

Run:  python bench/gpu/profile_step.py --model random:llama-3-8b --context 2048 --batch 128 --out DIR
Writes DIR/profile_b<batch>[_<kv>].txt: per mode, the kernels by total device time; with --host, the
host's functions by own time over the graphs mode's steps (cProfile: what the host does per step).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.gpu.decode_floor import build, headroom, set_mode, static_step, sync  # noqa: E402
from engine import SamplingParams  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:llama-3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--modes", default="triton,graphs,torch")
    ap.add_argument("--kv", default="raw", help="KV storage: raw, int8, ...")
    ap.add_argument("--host", action="store_true", help="also cProfile the host over the graphs mode's steps")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    modes = a.modes.split(",")
    cuda = a.device.startswith("cuda")
    report = []
    with tempfile.TemporaryDirectory() as tmp:
        llm = build(a.model, a.device, a.batch, a.context, (a.steps + 2) * len(modes), Path(tmp), a.kv)
        graphs = llm.decode_graphs or (static_step(llm, a.batch) if not cuda else None)  # CPU: eagerly
        vocab = llm.config.vocab_size
        g = torch.Generator().manual_seed(0)
        params = SamplingParams(max_tokens=headroom(a.batch, (a.steps + 2) * len(modes)), temperature=0.0,
                                ignore_eos=True)
        rids = [llm.add_request(torch.randint(3, vocab, (a.context,), generator=g).tolist(), params)
                for _ in range(a.batch)]
        while any(llm.requests[r].num_computed < a.context for r in rids):
            llm.step()
        for mode in modes:
            if mode == "graphs" and graphs is None:
                continue
            set_mode(llm, mode, graphs)
            for _ in range(2):
                llm.step()
            sync(a.device)
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=acts) as prof:
                for _ in range(a.steps):
                    llm.step()
                sync(a.device)
            key = "cuda_time_total" if cuda else "cpu_time_total"
            report.append(f"## mode {mode}: {a.steps} decode steps, batch {a.batch}, context ~{a.context}\n")
            report.append(prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=60))
            if a.host and mode == "graphs":
                report.append(host_profile(llm, a.steps, a.batch))
        for r in rids:
            llm.abort(r)
    text = "\n".join(report)
    tag = "" if a.kv == "raw" else f"_{a.kv}"
    (a.out / f"profile_b{a.batch}{tag}.txt").write_text(text)
    print(text)
    return 0


def host_profile(llm, steps: int, batch: int) -> str:
    """The host's own time per function over `steps` engine steps (the device work runs behind it)."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        llm.step()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(28)
    return f"## host (cProfile), graphs mode, {steps} steps, batch {batch}\n" + buf.getvalue()


if __name__ == "__main__":
    raise SystemExit(main())
