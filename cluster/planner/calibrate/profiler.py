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

On a GPU (`--device cuda`): the engine as it serves there (CUDA-graph decode, Triton attention: its
defaults), wall-clock timing with `torch.cuda.synchronize()` before and after each step (CPU time means
nothing there), the `gpu` grid (prefill steps of 512-8192 tokens, decode batches 1-128 at contexts
512-4096, sized for an 8B model in ~80 GB), no co-run entry (each GPU has its own HBM: factor 1). GPU
grids (`GPU_GRIDS`: the step's token budget) time each prefill point once untimed first (Triton and
cuBLAS pick kernels per shape), prefill a decode point's prompts over as many steps as its budget takes,
skip `DECODE_SKIP` decode steps, read each step's context from the engine's requests, keep one point per
decode batch (the median step at the median context), and abort the rows after the timed steps.
`--model random:<deploy/models name>` profiles that shape with random weights made on the device
(`random_model.py`: a GPU machine without model files); `--model DIR` any model directory; with `--model`
the spec is optional (the GPU machine has no pydantic to read one). `gpu-tiny` is the same path at tiny
sizes (CPU dry runs, tests).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from cluster.planner.calibrate.fit import fit_decode, fit_prefill

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
    # GPU: one prompt of up to 8064 tokens (+1 output stays within an 8192-position model) and batches of
    # prompts filling a step; decode up to 128 x 2048 (34 GB of an 8B model's KV) and 1-8 rows at 4096
    "gpu": ([[512], [1024], [2048], [4096], [8064], [512] * 4, [1024] * 4, [2048] * 4, [512] * 16],
            [(1, 512), (1, 2048), (1, 4096), (8, 1024), (8, 4096), (16, 512), (16, 2048), (32, 1024),
             (64, 512), (64, 2048), (128, 512), (128, 2048)]),
    "gpu-tiny": ([[16], [64], [32] * 4, [128], [256]], [(1, 64), (2, 128), (4, 32), (4, 256), (8, 64)]),
}
GPU_GRIDS = {"gpu": 8192, "gpu-tiny": 256}  # grid -> tokens per step (decode prompts may take several steps)
DECODE_SKIP = 2  # GPU grids: untimed decode steps at each decode point


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def cuda_sync(device: str = "cuda"):
    """A callable that waits for everything queued on `device`."""
    import torch

    return lambda: torch.cuda.synchronize(device)


def _timed_step(llm, clock, sync) -> float:
    if sync:
        sync()
    t0 = clock()
    llm.step()
    if sync:
        sync()
    return clock() - t0


def _run_batch(llm, lengths: list[int], decode_steps: int, rng: random.Random, clock=time.process_time,
               sync=None, budget: int | None = None):
    """Time one prefill step of `lengths` and `decode_steps` decode steps; returns both measurements.
    `sync`: called before and after each timed step (`cuda_sync(device)` on a GPU). `budget` (GPU grids): the
    step's token budget; the prompts may then take several steps, `DECODE_SKIP` decode steps go untimed and
    the rows are aborted after the timed ones (`_run_gpu_decodes`)."""
    from engine import SamplingParams

    vocab = llm.config.vocab_size
    if budget is not None and decode_steps:
        return _run_gpu_decodes(llm, lengths, decode_steps, rng, clock, sync, budget)
    params = SamplingParams(max_tokens=decode_steps + 1, temperature=0.0, ignore_eos=True)
    for n in lengths:
        llm.add_request([rng.randrange(vocab) for _ in range(n)], params)
    prefill = _timed_step(llm, clock, sync)
    decodes, context = [], sum(lengths) + len(lengths)
    for _ in range(decode_steps):
        decodes.append((len(lengths), context, _timed_step(llm, clock, sync)))
        context += len(lengths)
    while llm.has_unfinished():
        llm.step()
    return prefill, decodes


def _run_gpu_decodes(llm, lengths: list[int], decode_steps: int, rng: random.Random, clock, sync, budget: int):
    """Prefill `lengths` over as many steps as `budget` takes (early rows decode meanwhile), skip
    `DECODE_SKIP` decode steps, time `decode_steps` more, each at the context the engine's rows hold."""
    from engine import SamplingParams

    vocab = llm.config.vocab_size
    chunks = -(-sum(lengths) // budget) + 1  # steps an early row may decode while later prompts prefill
    params = SamplingParams(max_tokens=decode_steps + DECODE_SKIP + chunks + 2, temperature=0.0, ignore_eos=True)
    rids = [llm.add_request([rng.randrange(vocab) for _ in range(n)], params) for n in lengths]
    while any(llm.requests[r].num_computed < n for r, n in zip(rids, lengths) if r in llm.requests):
        llm.step()
    for _ in range(DECODE_SKIP):
        llm.step()
    decodes = []
    for _ in range(decode_steps):
        rows = [llm.requests[r] for r in rids if r in llm.requests]
        context = sum(len(q.token_ids) for q in rows)  # each row attends to its prompt + outputs so far
        decodes.append((len(rows), context, _timed_step(llm, clock, sync)))
    for r in rids:
        if r in llm.requests:
            llm.abort(r)
    while llm.has_unfinished():
        llm.step()
    return None, decodes


def measure(llm, grid: str, repeats: int, clock=time.process_time, log=print, sync=None) -> tuple[list, list]:
    prefill_grid, decode_grid = GRIDS[grid]
    budget = GPU_GRIDS.get(grid)
    warm = 1 if budget else 0  # GPU grids: each prefill shape once untimed (kernel choice per shape)
    rng = random.Random(0)
    _run_batch(llm, [32], 2, rng, clock, sync)  # warm-up: first-call allocations and kernels
    prefill_pts, decode_pts = [], []
    for lengths in prefill_grid:
        times = [_run_batch(llm, lengths, 0, rng, clock, sync)[0] for _ in range(repeats + warm)][warm:]
        prefill_pts.append((sum(lengths), sum(n * n for n in lengths), statistics.median(times)))
        log(f"  prefill {len(lengths)} x {lengths[0]}: {prefill_pts[-1][2] * 1000:.1f} ms")
    for batch, n in decode_grid:
        _, steps = _run_batch(llm, [n] * batch, DECODE_STEPS, rng, clock, sync, budget)
        if budget:  # GPU grids: one point per batch, its median step (a stray pause would pull the fit)
            steps = [(batch, statistics.median(c for _, c, _ in steps), statistics.median(s for *_, s in steps))]
        decode_pts += steps
        log(f"  decode batch {batch} x {n}: {statistics.median(s for _, _, s in steps) * 1000:.1f} ms/step")
    return prefill_pts, decode_pts


def _engine_for(spec_path: str | None, grid: str, device: str = "cpu", model: str | None = None,
                tmp: str | None = None, dtype: str | None = None):
    """The spec and an engine for `grid`: CPU grids fit every point in one step, one torch thread; GPU grids
    (`GPU_GRIDS`) take their step budget, the engine's device defaults and pages for the largest batch.
    Without a spec (`model` given: a GPU machine has no pydantic to read one), `dtype` or bfloat16."""
    from types import SimpleNamespace

    from cluster.planner.calibrate.random_model import is_random, random_llm
    from engine import LLM

    if spec_path:
        from cluster.spec import load_spec

        spec = load_spec(spec_path)
    else:
        spec = SimpleNamespace(model=model, revision=None, dtype="bfloat16")
    if dtype:
        spec = SimpleNamespace(model=spec.model, revision=spec.revision, dtype=dtype)
    prefill_grid, decode_grid = GRIDS[grid]
    seqs = max(max(len(b) for b in prefill_grid), max(b for b, _ in decode_grid))
    if grid not in GPU_GRIDS:
        budget = max(max(sum(b) for b in prefill_grid), max(b * n for b, n in decode_grid))
        pages = (budget + seqs * (DECODE_STEPS + 2)) // 16 + seqs + 8
        kw = dict(num_pages=pages, max_num_seqs=seqs, max_num_batched_tokens=budget, num_threads=1)
    else:
        budget = GPU_GRIDS[grid]
        assert all(sum(b) <= budget and len(b) <= seqs for b in prefill_grid), "a prefill point must fit one step"
        extra = DECODE_STEPS + DECODE_SKIP + 4 + max(b * n for b, n in decode_grid) // budget
        pages = max(max(b * -(-(n + extra) // 16) for b, n in decode_grid),
                    max(sum(-(-(n + 2) // 16) for n in b) for b in prefill_grid)) + seqs + 8
        kw = dict(num_pages=pages, max_num_seqs=seqs, max_num_batched_tokens=budget,
                  num_threads=1 if device == "cpu" else None)
    model = model or spec.model
    if is_random(model):
        return spec, random_llm(model, Path(tmp or tempfile.mkdtemp()), device=device, dtype=spec.dtype, **kw)
    revision = spec.revision if model == spec.model else None
    return spec, LLM(model=model, revision=revision, dtype=spec.dtype, device=device, **kw)


def _corun(spec, rounds: int, model: str | None = None) -> dict:
    from cluster.planner.calibrate.corun import measure_corun

    print(f"co-run interference: {rounds} rounds (decode and prefill steps beside an idle core, decode, prefill)")
    entry = measure_corun(model or spec.model, spec.dtype, rounds)
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
    """Add (or replace) the `serving` entry of an existing profile, from bench runs (`serving_fit.py`)."""
    from cluster.planner.calibrate.serving_fit import add_serving
    from cluster.planner.errors import BadConfigError

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


def resolve_options(args: argparse.Namespace) -> tuple[str, str, str, str | None]:
    """(device, grid, clock, problem): the CPU keeps its defaults (grid small, CPU clock); a GPU takes the
    `gpu` grid and the wall clock (its steps run on the device, not in this process's CPU time)."""
    device = getattr(args, "device", None) or "cpu"
    gpu = device.startswith("cuda")
    grid = args.grid or ("gpu" if gpu else "small")
    clock = args.clock or ("wall" if gpu else "cpu")
    problem = None
    if not getattr(args, "spec", None) and not getattr(args, "model", None):
        problem = "give a spec (its model and dtype are profiled) or --model"
    elif gpu and clock == "cpu":
        problem = "--clock cpu on a GPU would time the host only; use --clock wall (the default there)"
    elif gpu:
        import torch

        if not torch.cuda.is_available():
            problem = f"--device {device}: torch sees no CUDA device here"
    elif device != "cpu":
        problem = f"--device {device!r}: cpu or cuda[:N]"
    return device, grid, clock, problem


def _notes(args, grid: str, clock: str, device: str, start: float) -> str:
    spec = f" {args.spec}" if args.spec else ""
    when = time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())
    if not device.startswith("cuda"):  # the CPU profile's notes, as before
        return (f"pdserve profile{spec} --grid {grid} --repeats {args.repeats} --clock {clock}; "
                f"one torch thread; {when}; took {time.perf_counter() - start:.0f} s; {clock} clock on a machine "
                f"shared with other processes (noisy)")
    import torch

    model = f" --model {args.model}" if getattr(args, "model", None) else ""
    dtype = f" --dtype {args.dtype}" if getattr(args, "dtype", None) else ""
    return (f"pdserve profile{spec}{model}{dtype} --device {device} --grid {grid} --repeats {args.repeats}; "
            f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}; the engine's CUDA defaults (graph "
            f"decode, Triton attention); wall clock with torch.cuda.synchronize() around each step; {when}; took "
            f"{time.perf_counter() - start:.0f} s")


def run_profile(args: argparse.Namespace) -> int:
    from cluster.planner.errors import PlannerError

    if args.corun_only and not args.spec:
        print("error: --corun-only profiles the spec's model: give the spec", file=sys.stderr)
        return 2
    if args.corun_only:
        return run_corun_only(args)
    if args.serving_from:
        return run_serving_only(args)
    device, grid, clock, problem = resolve_options(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    gpu = device.startswith("cuda")
    spec_error: tuple = ()
    if args.spec:
        from cluster.spec import SpecError

        spec_error = (SpecError,)
    with tempfile.TemporaryDirectory(prefix="pdserve-profile-") as tmp:
        try:
            spec, llm = _engine_for(args.spec, grid, device, getattr(args, "model", None), tmp,
                                    getattr(args, "dtype", None))
        except spec_error as e:
            for p in e.problems:
                print(f"{args.spec}: {p}", file=sys.stderr)
            return 2
        except PlannerError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        model = getattr(args, "model", None) or spec.model
        start = time.perf_counter()
        print(f"profiling {model} ({spec.dtype}), " + (f"{device}, wall clock synchronised per step" if gpu else
                                                       "one torch thread") + f", grid {grid}", flush=True)
        sync = cuda_sync(device) if gpu else None
        prefill_pts, decode_pts = measure(llm, grid, args.repeats, CLOCKS[clock], sync=sync)
        del llm
    pf, df = fit_prefill(prefill_pts), fit_decode(decode_pts)
    for name, f in (("prefill", pf), ("decode", df)):
        print(f"{name}: a={f.coeffs[0]:.4g} b={f.coeffs[1]:.4g} c={f.coeffs[2]:.4g}; relative error mean "
              f"{f.mean_rel_err:.1%}, max {f.max_rel_err:.1%} over {f.points} points")
    from cluster.planner.calibrate.random_model import is_random

    corun = args.corun_rounds and not gpu and not is_random(model)
    if args.corun_rounds and not corun:
        print("co-run: not measured " + ("on a GPU (each has its own memory; the planner keeps factor 1)" if gpu else
                                         f"for {model} (its neighbour processes load real models)"))
    out = Path(args.out)
    profile = {
        "name": args.name or out.stem, "model": model, "dtype": spec.dtype, "hardware": args.hardware,
        **({"device": device} if gpu else {}),
        "tp": {"1": {"prefill": list(pf.coeffs), "decode": list(df.coeffs),
                     "fit": {"prefill": pf.as_dict(), "decode": df.as_dict()}}},
        "measurements": {"prefill": [list(p) for p in prefill_pts], "decode": [list(p) for p in decode_pts]},
        **({"corun": _corun(spec, args.corun_rounds, model)} if corun else {}),
        "notes": _notes(args, grid, clock, device, start),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile, indent=1) + "\n")
    print(f"wrote {out} ({time.perf_counter() - start:.0f} s)")
    return 0
