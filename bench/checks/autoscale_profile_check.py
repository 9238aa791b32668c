"""The planner's CPU profile, as the autoscaler plans with it, against the engine it plans for: one
`engine.LLM` of the spec's model (one torch thread, as each served replica runs) timed on prefill and decode
steps at the sizes bench/serving/autoscale_local.py reaches (prompts ~64-512 tokens, decode batches 1-8 at ~300
tokens of context each), side by side with the step times of `capacity_for_spec(spec)` (the profile's fit
with its `serving` calibration for the pool's mode, what `PlannerCapacity` simulates) and of the bare fit.

    python bench/checks/autoscale_profile_check.py                 # deploy/colocated.yaml, ~1 minute
    python bench/checks/autoscale_profile_check.py --clock cpu     # this process's CPU time (the profile's clock)

Order: build the planner's model first (no engine), then the engine, a warm-up batch, then each grid point
`--repeats` times (median; `cluster.planner.calibrate.profiler._run_batch`, the profiler's own timing); print
per point measured, modelled (served calibration and bare fit) and their ratio, and the geometric mean ratio per
kind; write JSON. On a shared machine wall-clock times include the neighbours: say which clock and load.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PREFILLS = ([64], [128], [256], [512], [256, 256])
DECODES = ((1, 300), (2, 300), (4, 300), (8, 300))
STEPS = 6


def planner_models(spec_path: str):
    from cluster.planner.inputs.hardware import load_hardware
    from cluster.planner.inputs.models import load_model
    from cluster.planner.latency.base import Parallel
    from cluster.planner.latency.profiles import latency_model
    from cluster.serving.autoscale_capacity import capacity_for_spec, profile_for
    from cluster.spec import load_spec

    spec = load_spec(spec_path)
    served = capacity_for_spec(spec).setups["colocated"].model
    profile = profile_for(spec)
    bare = latency_model(load_model(spec.model), load_hardware(profile.hardware), Parallel(), spec.dtype,
                         dataclasses.replace(profile, serving={}), mode="colocated") if profile is not None else served
    return spec, served, bare, (profile.name if profile is not None else "(hardware entry)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", default=str(ROOT / "deploy" / "colocated.yaml"))
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "autoscale-profile-check.json"))
    a = ap.parse_args(argv)
    from cluster.planner.calibrate.profiler import CLOCKS, _run_batch
    from engine import LLM

    spec, served, bare, pname = planner_models(a.spec)
    clock = CLOCKS[a.clock]
    llm = LLM(model=spec.model, revision=spec.revision, dtype=spec.dtype, num_pages=512, max_num_seqs=16,
              max_num_batched_tokens=1024, num_threads=1)
    rng = random.Random(0)
    _run_batch(llm, [32], 2, rng, clock)  # warm-up
    rows = []
    for lengths in PREFILLS:
        t = statistics.median(_run_batch(llm, lengths, 0, rng, clock)[0] for _ in range(a.repeats))
        tok, sq = sum(lengths), sum(n * n for n in lengths)
        rows.append(("prefill", f"{len(lengths)}x{lengths[0]}", t, served.prefill(tok, sq), bare.prefill(tok, sq)))
    for batch, n in DECODES:
        steps = []
        for _ in range(a.repeats):
            steps += _run_batch(llm, [n] * batch, STEPS, rng, clock)[1]
        t = statistics.median(s for _, _, s in steps)
        ctx = statistics.median(c for _, c, _ in steps)
        rows.append(("decode", f"batch {batch} x {n}", t, served.decode(batch, ctx), bare.decode(batch, ctx)))
    print(f"{spec.model} ({spec.dtype}), profile {pname}; clock {a.clock}; load {os.getloadavg()[0]:.2f}")
    print(f"{'kind':8} {'point':16} {'engine ms':>10} {'served model ms':>16} {'bare fit ms':>12} {'model/engine':>13}")
    for kind, point, t, m, b in rows:
        print(f"{kind:8} {point:16} {t * 1e3:10.1f} {m * 1e3:16.1f} {b * 1e3:12.1f} {m / t:12.2f}x")
    summary = {}
    for kind in ("prefill", "decode"):
        rs = [(m / t, b / t) for k, _, t, m, b in rows if k == kind]
        summary[kind] = {"served_over_engine": math.exp(sum(math.log(x) for x, _ in rs) / len(rs)),
                         "bare_over_engine": math.exp(sum(math.log(y) for _, y in rs) / len(rs))}
        print(f"{kind}: the model as served / the engine x{summary[kind]['served_over_engine']:.2f} "
              f"(bare fit x{summary[kind]['bare_over_engine']:.2f}), geometric mean over {len(rs)} points")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"clock": a.clock, "profile": pname, "time": time.strftime("%Y-%m-%d %H:%M UTC",
                              time.gmtime()), "load": os.getloadavg()[0], "summary": summary,
                               "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
