"""`pdserve profile SPEC --out deploy/profiles/NAME.json`: time the real engine, fit the planner's forms.

Order: read the spec (its model and dtype), start one `engine.LLM` with one torch thread, warm it up,
then for each grid point add requests of the given prompt lengths (random token ids, greedy, EOS
ignored), time the first `step()` (one prefill batch: all prompts fit the token budget) and the next
`DECODE_STEPS` steps (decode batches of that size, context growing by one per sequence per step). Fit
prefill t = a + b*T + c*SQ and decode t = a + b*C + c*B (`fit`), print the fit error, write the profile
(coefficients under TP 1, the fit error, the raw points) that `pdserve plan --profile` reads.
Then (unless `--corun-rounds 0`) `corun.measure_corun` times steps beside a neighbour process on the
other core and records the slowdown factors under `corun` (`--corun-only`: just that, into an existing
profile, keeping its fit). Timings are this process's CPU time by default (`--clock cpu`: one torch thread, so CPU time is what
the step would take on an idle core; wall-clock on a shared machine mostly measures the neighbours);
`--clock wall` measures wall-clock instead. Either way the machine's other load adds noise (notes say so).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from cluster.planner.fit import fit_decode, fit_prefill

DECODE_STEPS = 6
# prefill batches (prompt lengths) and decode batches (batch size, prompt length each)
GRIDS = {
    "tiny": ([[16], [64], [32, 32], [128]], [(1, 32), (2, 32), (4, 16)]),
    "small": ([[16], [64], [128], [256], [512], [1024], [2048], [32] * 4, [64] * 8, [128] * 8, [256] * 4,
               [512] * 2, [64] * 16, [1024] * 2],
              [(1, 128), (1, 1024), (4, 256), (8, 128), (8, 512), (16, 64), (16, 256), (32, 64), (32, 128)]),
    "large": ([[n] for n in (16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048, 3072)] +
              [[n] * k for n in (32, 128, 512) for k in (2, 4, 8)],
              [(b, n) for b in (1, 2, 4, 8, 16, 32, 64) for n in (64, 256, 1024)]),
}


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def _run_batch(llm, lengths: list[int], decode_steps: int, rng: random.Random, clock=time.process_time):
    """Time one prefill step of `lengths` and `decode_steps` decode steps; returns both measurements."""
    from engine import SamplingParams

    vocab = llm.config.vocab_size
    params = SamplingParams(max_tokens=decode_steps + 1, temperature=0.0, ignore_eos=True)
    for n in lengths:
        llm.add_request([rng.randrange(vocab) for _ in range(n)], params)
    t0 = clock()
    llm.step()
    prefill = clock() - t0
    decodes, context = [], sum(lengths) + len(lengths)
    for _ in range(decode_steps):
        t0 = clock()
        llm.step()
        decodes.append((len(lengths), context, clock() - t0))
        context += len(lengths)
    while llm.has_unfinished():
        llm.step()
    return prefill, decodes


def measure(llm, grid: str, repeats: int, clock=time.process_time, log=print) -> tuple[list, list]:
    prefill_grid, decode_grid = GRIDS[grid]
    rng = random.Random(0)
    _run_batch(llm, [32], 2, rng, clock)  # warm-up: first-call allocations and kernels
    prefill_pts, decode_pts = [], []
    for lengths in prefill_grid:
        times = [_run_batch(llm, lengths, 0, rng, clock)[0] for _ in range(repeats)]
        prefill_pts.append((sum(lengths), sum(n * n for n in lengths), statistics.median(times)))
        log(f"  prefill {len(lengths)} x {lengths[0]}: {prefill_pts[-1][2] * 1000:.1f} ms")
    for batch, n in decode_grid:
        _, steps = _run_batch(llm, [n] * batch, DECODE_STEPS, rng, clock)
        decode_pts += steps
        log(f"  decode batch {batch} x {n}: {statistics.median(s for _, _, s in steps) * 1000:.1f} ms/step")
    return prefill_pts, decode_pts


def _engine_for(spec_path: str, grid: str):
    from cluster.spec import load_spec
    from engine import LLM

    spec = load_spec(spec_path)
    prefill_grid, decode_grid = GRIDS[grid]
    budget = max(max(sum(b) for b in prefill_grid), max(b * n for b, n in decode_grid))
    seqs = max(max(len(b) for b in prefill_grid), max(b for b, _ in decode_grid))
    pages = (budget + seqs * (DECODE_STEPS + 2)) // 16 + seqs + 8
    llm = LLM(model=spec.model, revision=spec.revision, dtype=spec.dtype, num_pages=pages, max_num_seqs=seqs,
              max_num_batched_tokens=budget, num_threads=1)
    return spec, llm


def _corun(spec, rounds: int) -> dict:
    from cluster.planner.corun import measure_corun

    print(f"co-run interference: {rounds} rounds (decode and prefill steps beside an idle core, decode, prefill)")
    entry = measure_corun(spec.model, spec.dtype, rounds)
    for key, f in entry["slowdown"].items():
        lo, hi = entry["spread"][key]
        print(f"  {key}: x{f:.3f} (rounds {lo:.2f}-{hi:.2f}; wall x{entry['wall_slowdown'][key]:.3f})")
    return entry


def run_corun_only(args: argparse.Namespace) -> int:
    """Add (or replace) the `corun` entry of an existing profile."""
    from cluster.spec import SpecError, load_spec

    out = Path(args.out)
    try:
        spec = load_spec(args.spec)
        profile = json.loads(out.read_text())
    except SpecError as e:
        for p in e.problems:
            print(f"{args.spec}: {p}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:
        print(f"{out}: {e} (--corun-only adds to an existing profile)", file=sys.stderr)
        return 2
    profile["corun"] = _corun(spec, args.corun_rounds or 5)
    profile["corun"]["method"] += f"; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    out.write_text(json.dumps(profile, indent=1) + "\n")
    print(f"wrote {out} (corun)")
    return 0


def run_serving_only(args: argparse.Namespace) -> int:
    """Add (or replace) the `serving` entry of an existing profile, from bench runs (`serving.py`)."""
    from cluster.planner.errors import BadConfigError
    from cluster.planner.serving import add_serving

    out = Path(args.out)
    try:
        profile = json.loads(out.read_text())
        benches = [json.loads(Path(path).read_text()) for path in args.serving_from]
        entry = add_serving(profile, benches, source=" ".join(args.serving_from))
    except KeyError as e:
        print(f"{out}: no {e} (--serving-from adds to an existing profile with a TP 1 fit)", file=sys.stderr)
        return 2
    except (OSError, ValueError, BadConfigError) as e:
        print(f"{out}: {e}", file=sys.stderr)
        return 2
    out.write_text(json.dumps(profile, indent=1) + "\n")
    print(f"serving ({entry['mode']}): prefill x{entry['prefill_factor']:.3f}, decode x{entry['decode_factor']:.3f}, admission "
          f"{1000 * entry['admission_s']:.0f} ms over {entry['points']} requests; wrote {out}")
    return 0


def run_profile(args: argparse.Namespace) -> int:
    from cluster.spec import SpecError

    if args.corun_only:
        return run_corun_only(args)
    if args.serving_from:
        return run_serving_only(args)
    try:
        spec, llm = _engine_for(args.spec, args.grid)
    except SpecError as e:
        for p in e.problems:
            print(f"{args.spec}: {p}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    print(f"profiling {spec.model} ({spec.dtype}), one torch thread, grid {args.grid}")
    prefill_pts, decode_pts = measure(llm, args.grid, args.repeats, CLOCKS[args.clock])
    pf, df = fit_prefill(prefill_pts), fit_decode(decode_pts)
    for name, f in (("prefill", pf), ("decode", df)):
        print(f"{name}: a={f.coeffs[0]:.4g} b={f.coeffs[1]:.4g} c={f.coeffs[2]:.4g}; relative error mean "
              f"{f.mean_rel_err:.1%}, max {f.max_rel_err:.1%} over {f.points} points")
    out = Path(args.out)
    profile = {
        "name": args.name or out.stem, "model": spec.model, "dtype": spec.dtype, "hardware": args.hardware,
        "tp": {"1": {"prefill": list(pf.coeffs), "decode": list(df.coeffs),
                     "fit": {"prefill": pf.as_dict(), "decode": df.as_dict()}}},
        "measurements": {"prefill": [list(p) for p in prefill_pts], "decode": [list(p) for p in decode_pts]},
        **({"corun": _corun(spec, args.corun_rounds)} if args.corun_rounds else {}),
        "notes": (f"pdserve profile {args.spec} --grid {args.grid} --repeats {args.repeats} --clock {args.clock}; "
                  f"one torch thread; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; took "
                  f"{time.perf_counter() - start:.0f} s; {args.clock} clock on a machine shared with other "
                  f"processes (noisy)"),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile, indent=1) + "\n")
    print(f"wrote {out} ({time.perf_counter() - start:.0f} s)")
    return 0
