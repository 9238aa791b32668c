"""Bench workloads: what to send and when. Pure Python (no network, no tokenizer).

    load_workload(desc, num_requests, seed, scaling) -> Workload   # `--workload DESC`
    workload.at_rate(rate) -> [RequestSpec]                        # arrivals for one load level

A `Workload` keeps its arrival pattern normalised to a mean rate of 1 request/s (`unit_arrivals_s`);
`at_rate(r)` divides every time by r, so every rate (and every spec of a `--compare`) replays the same
seeded sequence of gaps, only faster or slower. `at_rate(None)` keeps a trace's own timing.

Descriptions (`--workload`):
    random:input=256,output=64,range=0.25,burstiness=1   synthetic (vLLM's `random` dataset): lengths
        uniform in [L*(1-range), L*(1+range)]; `dist=lognormal,sigma=0.5` draws lognormal lengths with
        median L instead. Arrivals: gamma gaps with shape `burstiness` (CV = 1/sqrt(burstiness); 1 is
        Poisson, < 1 burstier; `cv=2` is the same as burstiness=0.25). Seeded by `--seed`.
    azure-code | azure-conv | mooncake   the traces in data/workloads (README there), or a path to an
        Azure 2023 CSV (TIMESTAMP, ContextTokens, GeneratedTokens) or a Mooncake JSONL (timestamp in ms,
        input_length, output_length). Rows `start`, `start + stride`, ... (`--trace-start`, `--trace-stride`),
        `num_requests` of them. Stride 1 replays a contiguous slice: a few dozen requests then cover
        seconds of the original hour and its bursts (Azure code: the first 30 rows are two bursts,
        gap CV 4.5). A stride k thins the trace (every k-th request over k x num_requests rows), which
        keeps the rate's shape over a longer window and breaks up sub-second bursts.
    mooncake:sessions=N,min_turns=2   whole Mooncake conversations instead of a slice (mooncake.py): the
        first N conversations with >= min_turns turns, all their rows. Mooncake requests carry their
        `hash_ids` blocks (`RequestSpec.block_ids`), so prompts repeat the prefixes the trace repeats.

Trace scaling (the traces were served on large GPUs; this machine is 2 CPU cores), defaults in
`TraceScaling`, recorded in the output JSON:
    time    gaps keep their pattern; at_rate(r) scales them so the slice's mean rate is r
    stride  1 (contiguous); see above
    input   tokens x 0.25, clipped to [4, 1024]   (Azure code: median 1469 -> ~367, p90 clipped at 1024)
    output  tokens x 0.5, clipped to [1, 256]      (Azure conv: median 129 -> ~64; code: 13 -> ~6)
    blocks  Mooncake's 512-token prefix blocks x input scale (128 tokens at 0.25)
"""
from __future__ import annotations

import csv
import math
import os
import random
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

from cluster.bench import mooncake

MOONCAKE_BLOCK = 512  # tokens per `hash_ids` entry in the Mooncake trace
TRACES = {"azure-code": "azure_llm_2023_code.csv", "azure-conv": "azure_llm_2023_conv.csv",
          "mooncake": "mooncake_conversation_trace.jsonl"}


class WorkloadError(ValueError):
    """A `--workload` description or trace file that cannot be used; the message says why."""


@dataclass(frozen=True)
class RequestSpec:
    index: int
    arrival_s: float  # seconds after the start of the run
    input_len: int
    output_len: int
    block_ids: tuple[int, ...] = ()  # Mooncake: one id per prompt block; equal ids = equal block content
    round: int = 0  # which probe of a run sent it: prompts differ between rounds (see prompts.py)


@dataclass(frozen=True)
class TraceScaling:
    input_scale: float = 0.25
    output_scale: float = 0.5
    min_input: int = 4
    max_input: int = 1024
    min_output: int = 1
    max_output: int = 256

    def input(self, n: int) -> int:
        return _clip(round(n * self.input_scale), self.min_input, self.max_input)

    def output(self, n: int) -> int:
        return _clip(round(n * self.output_scale), self.min_output, self.max_output)

    def block(self, n: int = MOONCAKE_BLOCK) -> int:
        """Tokens of one prefix block (the trace's 512) after scaling, so blocks scale with prompts."""
        return max(1, round(n * self.input_scale))


@dataclass
class Workload:
    name: str
    unit_arrivals_s: list[float]  # arrival times at a mean rate of 1 request/s, first at 0
    input_lens: list[int]
    output_lens: list[int]
    native_rate: float | None = None  # a trace's own mean rate (requests/s); None for synthetic
    info: dict = field(default_factory=dict)  # description and scaling, for the output JSON
    block_ids: list[tuple[int, ...]] | None = None  # Mooncake: per request, its prefix blocks' ids
    block_tokens: int | None = None  # tokens per block after scaling

    def __len__(self) -> int:
        return len(self.input_lens)

    def at_rate(self, rate: float | None, duration_s: float | None = None, round_no: int = 0) -> list[RequestSpec]:
        """Requests with arrivals for `rate` (None: the trace's own timing); only those arriving before
        `duration_s` when it is given. `round_no` numbers the probe (prompts differ between rounds)."""
        if rate is None:
            if self.native_rate is None:
                raise WorkloadError(f"{self.name}: a synthetic workload needs a rate")
            rate = self.native_rate
        assert rate > 0, rate
        out = []
        for i, (t, n_in, n_out) in enumerate(zip(self.unit_arrivals_s, self.input_lens, self.output_lens)):
            if duration_s is not None and t / rate > duration_s:
                break
            blocks = self.block_ids[i] if self.block_ids is not None else ()
            out.append(RequestSpec(i, t / rate, n_in, n_out, blocks, round_no))
        return out


def _clip(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, n))


def _normalise(times: list[float]) -> tuple[list[float], float | None]:
    """Times shifted to start at 0 and scaled to a mean rate of 1/s; the original mean rate."""
    t0 = times[0]
    span = times[-1] - t0
    if len(times) < 2 or span <= 0:
        return [float(i) for i in range(len(times))], None  # all at once: spread evenly at rate 1
    rate = (len(times) - 1) / span
    return [(t - t0) * rate for t in times], rate


# ---- synthetic --------------------------------------------------------------------------------
def parse_options(text: str) -> dict[str, str]:
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        if not eq or not key or not value:
            raise WorkloadError(f"expected key=value, got {part!r}")
        out[key.strip()] = value.strip()
    return out


def synthetic(options: dict[str, str], num_requests: int, seed: int) -> Workload:
    known = {"input", "output", "range", "dist", "sigma", "burstiness", "cv"}
    unknown = set(options) - known
    if unknown:
        raise WorkloadError(f"random: unknown option(s) {sorted(unknown)}; known: {sorted(known)}")
    try:
        n_in, n_out = int(options.get("input", 256)), int(options.get("output", 64))
        spread, sigma = float(options.get("range", 0.0)), float(options.get("sigma", 0.5))
        shape = float(options.get("burstiness", 1.0))
        if "cv" in options:
            shape = 1.0 / float(options["cv"]) ** 2
    except ValueError as e:
        raise WorkloadError(f"random: {e}") from None
    dist = options.get("dist", "uniform")
    if dist not in ("uniform", "lognormal"):
        raise WorkloadError(f"random: dist must be uniform or lognormal, not {dist!r}")
    if n_in < 1 or n_out < 1 or not 0 <= spread < 1 or shape <= 0 or sigma < 0:
        raise WorkloadError("random: need input, output >= 1, 0 <= range < 1, burstiness > 0, sigma >= 0")
    rng = random.Random(seed)
    gaps = [rng.gammavariate(shape, 1.0 / shape) for _ in range(num_requests)]  # mean 1, CV 1/sqrt(shape)

    def length(base: int) -> int:
        if dist == "lognormal":
            return max(1, round(base * math.exp(rng.gauss(0.0, sigma))))
        return rng.randint(max(1, math.floor(base * (1 - spread))), math.ceil(base * (1 + spread)))

    arrivals, t = [], 0.0
    ins, outs = [], []
    for g in gaps:
        arrivals.append(t)
        t += g
        ins.append(length(n_in))
        outs.append(length(n_out))
    info = {"kind": "random", "input": n_in, "output": n_out, "dist": dist, "range": spread, "sigma": sigma,
            "burstiness": shape, "arrivals": "poisson" if shape == 1.0 else f"gamma(shape={shape:g})",
            "seed": seed}
    return Workload("random", arrivals, ins, outs, None, info)


# ---- traces -----------------------------------------------------------------------------------
def workloads_dir() -> Path:
    env = os.environ.get("PDSERVE_WORKLOADS")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "data" / "workloads"


def _azure_rows(path: Path, start: int, n: int, stride: int) -> list[tuple[float, int, int]]:
    rows = []
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or [])
        if missing:
            raise WorkloadError(f"{path}: not an Azure 2023 trace, missing columns {sorted(missing)}")
        for i, row in enumerate(reader):
            if i < start or (i - start) % stride:
                continue
            if len(rows) >= n:
                break
            t = datetime.fromisoformat(row["TIMESTAMP"].strip()).timestamp()
            rows.append((t, int(row["ContextTokens"]), int(row["GeneratedTokens"])))
    return rows


def trace(path: Path, num_requests: int, start: int = 0, scaling: TraceScaling = TraceScaling(),
          stride: int = 1, sessions: tuple[int, int] | None = None) -> Workload:
    """A trace slice; `sessions=(N, min_turns)` samples whole Mooncake conversations (mooncake.py)."""
    if not path.is_file():
        raise WorkloadError(f"{path}: no such trace file")
    if start < 0 or stride < 1:
        raise WorkloadError(f"need --trace-start >= 0 and --trace-stride >= 1, got {start}, {stride}")
    if sessions is not None and path.suffix != ".jsonl":
        raise WorkloadError(f"{path}: sessions=N needs a Mooncake trace (.jsonl with hash_ids)")
    try:
        if sessions is not None:
            rows = mooncake.read_sessions(path, start, num_requests, *sessions)
        elif path.suffix == ".jsonl":
            rows = mooncake.read_rows(path, start, num_requests, stride)
        else:
            rows = _azure_rows(path, start, num_requests, stride)
    except mooncake.MooncakeError as e:
        raise WorkloadError(str(e)) from None
    if not rows:
        raise WorkloadError(f"{path}: no requests from index {start}")
    rows.sort(key=lambda r: r[0])  # stable: equal timestamps keep file order
    arrivals, rate = _normalise([r[0] for r in rows])
    info = {"kind": "trace", "path": str(path), "start": start, "stride": stride, "requests": len(rows),
            "native_rate": rate, "scaling": asdict(scaling),
            "time": "gaps scaled by one factor so the slice's mean rate equals the requested rate",
            "raw_input_mean": sum(r[1] for r in rows) / len(rows),
            "raw_output_mean": sum(r[2] for r in rows) / len(rows)}
    blocks = [r[3] for r in rows] if path.suffix == ".jsonl" else None
    if blocks is not None:
        info.update(block_tokens=scaling.block(), block_hit_rate=mooncake.block_hit_rate(blocks),
                    blocks=f"each {MOONCAKE_BLOCK}-token hash_ids block -> {scaling.block()} tokens "
                           "(input_scale); equal ids give equal token blocks")
        if sessions is not None:
            info.update(sessions=sessions[0], min_turns=sessions[1],
                        sampling="whole conversations, trace order and gaps (see cluster/bench/mooncake.py)")
    return Workload(path.stem, arrivals, [scaling.input(r[1]) for r in rows],
                    [scaling.output(r[2]) for r in rows], rate, info, blocks,
                    scaling.block() if blocks is not None else None)


def load_workload(desc: str, num_requests: int, seed: int = 0, scaling: TraceScaling = TraceScaling(),
                  start: int = 0, stride: int = 1) -> Workload:
    """`--workload DESC`: `random[:k=v,...]`, a trace name (azure-code, azure-conv, mooncake) or path."""
    if num_requests < 1:
        raise WorkloadError("need at least one request")
    kind, _, opts = desc.partition(":")
    if kind == "random":
        return synthetic(parse_options(opts), num_requests, seed)
    if kind not in TRACES and Path(desc).exists():
        kind, opts = desc, ""  # a path that happens to hold a colon
    path = workloads_dir() / TRACES[kind] if kind in TRACES else Path(kind)
    sessions = None
    if opts:
        options = parse_options(opts)
        unknown = set(options) - {"sessions", "min_turns"}
        if unknown:
            raise WorkloadError(f"{kind}: unknown option(s) {sorted(unknown)}; known: ['min_turns', 'sessions']")
        try:
            sessions = (int(options.get("sessions", 0)), int(options.get("min_turns", 2)))
        except ValueError as e:
            raise WorkloadError(f"{kind}: {e}") from None
    return trace(path, num_requests, start, scaling, stride, sessions)
