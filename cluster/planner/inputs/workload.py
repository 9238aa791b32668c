"""Workloads for the planner: request lengths from a trace or a distribution, Poisson arrivals at a rate.

    lengths = trace_lengths("azure_llm_2023_conv.csv")   (input, output) pairs; Azure CSV or Mooncake JSONL
    lengths = distribution_lengths("uniform:128:1024", "512", n, seed)
    reqs = poisson_requests(lengths, rate, n, seed, max_len)

`poisson_requests` uses common random numbers: the same seed gives the same unit gaps and the same
length draws at every rate (arrivals = gaps / rate), so attainment is a smooth, near-monotone function
of the rate and the search's bisection is stable. The planner keeps the trace's lengths, not its
arrival times (a rate sweep needs rescaled arrivals anyway). Its own minimal reader: `cluster.bench`
has the full trace readers. Pure Python.
"""
from __future__ import annotations

import csv
import functools
import json
import random
from pathlib import Path
from typing import NamedTuple

from cluster.planner.errors import PlannerError


class Request(NamedTuple):
    """One simulated request. A NamedTuple, not a dataclass: every probe of the search builds thousands
    and a frozen dataclass's __init__ is several times slower; it is just as immutable."""
    arrival: float  # seconds
    input_len: int
    output_len: int  # tokens generated, the first one (from prefill) included


def trace_lengths(path: str | Path) -> list[tuple[int, int]]:
    """(input, output) lengths of every request in an Azure LLM CSV (ContextTokens, GeneratedTokens) or a
    Mooncake JSONL (input_length, output_length)."""
    path = Path(path)
    if not path.is_file():
        raise PlannerError(f"workload {path}: no such file (the repository's traces are in data/workloads/)")
    pairs: list[tuple[int, int]] = []
    with path.open() as f:
        if path.suffix == ".jsonl":
            for line in f:
                if line.strip():
                    d = json.loads(line)
                    pairs.append((int(d["input_length"]), int(d["output_length"])))
        else:
            reader = csv.DictReader(f)
            if not {"ContextTokens", "GeneratedTokens"} <= set(reader.fieldnames or []):
                raise PlannerError(f"workload {path}: expected CSV columns ContextTokens, GeneratedTokens "
                                   f"(Azure) or a .jsonl with input_length, output_length (Mooncake)")
            pairs = [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in reader]
    if not pairs:
        raise PlannerError(f"workload {path}: no requests")
    return pairs


def _sampler(text: str, what: str):
    """`N` (fixed), `uniform:LO:HI`, `exp:MEAN` (geometric-like, at least 1)."""
    parts = text.split(":")
    try:
        if len(parts) == 1:
            n = int(parts[0])
            return lambda rng: n
        kind, args = parts[0], [float(x) for x in parts[1:]]
        if kind == "uniform" and len(args) == 2:
            lo, hi = int(args[0]), int(args[1])
            return lambda rng: rng.randint(lo, hi)
        if kind == "exp" and len(args) == 1:
            mean = args[0]
            return lambda rng: max(1, int(rng.expovariate(1.0 / mean)))
    except ValueError:
        pass
    raise PlannerError(f"--{what} {text!r}: give N, uniform:LO:HI or exp:MEAN")


def distribution_lengths(input_len: str, output_len: str, n: int = 2000, seed: int = 0) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    si, so = _sampler(input_len, "input-len"), _sampler(output_len, "output-len")
    return [(max(1, si(rng)), max(1, so(rng))) for _ in range(n)]


def clamp(pairs: list[tuple[int, int]], max_len: int) -> list[tuple[int, int]]:
    """Fit each request into the model's context: prompt first (keep >= 1 output token), then output."""
    out = []
    for i, o in pairs:
        i = min(max(1, i), max_len - 1)
        out.append((i, max(1, min(o, max_len - i))))
    return out


def scale_lengths(pairs: list[tuple[int, int]], input_scale: float = 1.0, output_scale: float = 1.0,
                  max_input: int | None = None, max_output: int | None = None) -> list[tuple[int, int]]:
    """Trace lengths as `pdserve bench` replays them (its --input-scale/--output-scale/--max-input/--max-output:
    rounded, at least 4 prompt and 1 output token, then capped), so a plan and a bench see one workload."""
    if input_scale <= 0 or output_scale <= 0:
        raise PlannerError(f"length scales must be > 0 (got input {input_scale}, output {output_scale})")
    big = 1 << 62
    return [(min(max(4, round(i * input_scale)), max_input or big), min(max(1, round(o * output_scale)), max_output or big))
            for i, o in pairs]


def subsample(pairs: list[tuple[int, int]], n: int = 4000, seed: int = 0) -> list[tuple[int, int]]:
    """At most `n` pairs drawn without replacement (seeded): what the simulations sample from."""
    return pairs if len(pairs) <= n else random.Random(seed).sample(pairs, n)


@functools.lru_cache(maxsize=64)
def _unit_draws(n: int, population: int, seed: int) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """Cumulative unit-rate arrival times and length indices: the same for every probed rate."""
    rng = random.Random(seed)
    t, times, idx = 0.0, [], []
    for _ in range(n):
        t += rng.expovariate(1.0)
        times.append(t)
        idx.append(rng.randrange(population))
    return tuple(times), tuple(idx)


def poisson_requests(pairs: list[tuple[int, int]], rate: float, n: int, seed: int = 0) -> list[Request]:
    """`n` requests with Poisson arrivals at `rate` req/s and lengths drawn from `pairs`."""
    assert rate > 0 and pairs
    times, idx = _unit_draws(n, len(pairs), seed)
    new = tuple.__new__  # Request(...) without the NamedTuple's Python-level __new__ (the same tuple)
    return [new(Request, (t / rate, *pairs[k])) for t, k in zip(times, idx)]
