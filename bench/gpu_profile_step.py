"""torch.profiler over a few decode steps at one batch size, per engine path: where a step's GPU and host time
go (issue 32's device check; bench/gpu_decode_floor.py has the step times against the floor).

Run:  python bench/gpu_profile_step.py --model random:llama-3-8b --context 2048 --batch 128 --out DIR
Writes DIR/profile_b<batch>.txt: per mode, the kernels by total device time, and the step's host time.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.gpu_decode_floor import build, headroom, set_mode, sync  # noqa: E402
from engine import SamplingParams  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:llama-3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--modes", default="triton,graphs,torch")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    modes = a.modes.split(",")
    cuda = a.device.startswith("cuda")
    report = []
    with tempfile.TemporaryDirectory() as tmp:
        llm = build(a.model, a.device, a.batch, a.context, (a.steps + 2) * len(modes), Path(tmp))
        graphs = llm.decode_graphs
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
        for r in rids:
            llm.abort(r)
    text = "\n".join(report)
    (a.out / f"profile_b{a.batch}.txt").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
