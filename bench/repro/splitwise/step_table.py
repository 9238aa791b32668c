"""A latency model read from a table of measured iteration times by batch tokens (Splitwise's artifact).

    TableLatency(StepTable.load(model, hardware[, path]))
    TableMemory.load(model[, path])          # the artifact's KV space per instance

The artifact's performance model (splitwise-sim performance_model.py, its data in
deploy/profiles/splitwise-perf-model.yaml): an iteration holding any prompt takes `prompt_ms` at its batch
tokens (prompt tokens plus one per decoding request); one of decoding requests only takes `token_ms` at
their count, whatever their context; linear interpolation between the measured points and linear
extrapolation beyond the two end ones (scipy's interp1d with fill_value="extrapolate"); an iteration of
prompts and decoding requests together costs 1.1x the prompt time at its batch tokens. One TP-8 instance,
no pipeline stages. Used by bench/repro/splitwise/repro.py --perf artifact; pure Python.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import yaml

from cluster.planner.latency.base import LatencyModel, Line, Parallel

MIXED_FACTOR = 1.1  # the artifact's price of a prompt and decoding requests in one iteration (performance_model.py)
DEFAULT_PATH = Path(__file__).resolve().parents[3] / "deploy" / "profiles" / "splitwise-perf-model.yaml"


class StepTableError(ValueError):
    """The table file has no entry for this model and hardware, or a malformed one."""


def interp_extrapolated(xs: tuple[float, ...], ys: tuple[float, ...], x: float) -> float:
    """Piecewise-linear through (xs, ys), continued linearly past either end."""
    if x <= xs[0]:
        i = 0
    elif x >= xs[-1]:
        i = len(xs) - 2
    else:
        i = next(k for k in range(len(xs) - 1) if xs[k] <= x <= xs[k + 1])
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return y0 + (x - x0) * (y1 - y0) / (x1 - x0)


@functools.lru_cache(maxsize=4)
def _read(path: Path) -> dict:
    """The parsed table file, once per process (every design and pool size loads its machines' tables)."""
    return yaml.safe_load(path.read_text())


@dataclass(frozen=True)
class StepTable:
    batch_tokens: tuple[float, ...]
    prompt_s: tuple[float, ...]
    token_s: tuple[float, ...]

    @classmethod
    def load(cls, model: str, hardware: str, path: Path = DEFAULT_PATH) -> "StepTable":
        data = _read(Path(path))
        try:
            e = data["tables"][model][hardware]
            xs = tuple(float(x) for x in e["batch_tokens"])
            p, t = tuple(e["prompt_ms"]), tuple(e["token_ms"])
        except (KeyError, TypeError) as err:
            raise StepTableError(f"{path}: no table for model {model!r} on {hardware!r} ({err})") from None
        if len(xs) < 2 or not len(xs) == len(p) == len(t) or list(xs) != sorted(set(xs)):
            raise StepTableError(f"{path}: {model}/{hardware}: batch_tokens must rise, with one prompt_ms and "
                                 f"token_ms each")
        return cls(xs, tuple(v / 1000 for v in p), tuple(v / 1000 for v in t))

    def prompt(self, batch_tokens: float) -> float:
        return interp_extrapolated(self.batch_tokens, self.prompt_s, batch_tokens)

    def token(self, batch: float) -> float:
        return interp_extrapolated(self.batch_tokens, self.token_s, batch)


@dataclass(frozen=True)
class TableMemory:
    """The table file's memory accounting for one model: KV tokens one instance holds, KV bytes per token,
    and the prompt-to-token machine link (bytes/s; a prompt's KV crosses it whole, after the prompt)."""
    kv_tokens: int
    kv_bytes_per_token: float
    link_bytes_per_s: float

    @classmethod
    def load(cls, model: str, path: Path = DEFAULT_PATH) -> "TableMemory":
        data = _read(Path(path))
        try:
            mem, m = data["memory"], data["memory"]["models"][model]
            per_token = 2.0 * m["hidden"] * m["layers"] * 2
            free = mem["gpus"] * mem["gpu_bytes"] - m["weights_bytes"]
        except (KeyError, TypeError) as err:
            raise StepTableError(f"{path}: no memory entry for model {model!r} ({err})") from None
        if free <= 0:
            raise StepTableError(f"{path}: {model}'s weights do not fit the instance's memory")
        return cls(int(free // per_token), per_token, float(mem["link_bytes_per_s"]))


class TableLatency(LatencyModel):
    """`StepTable` behind the simulators' interface: prefill by prompt tokens, decode by batch size only
    (no context term: the artifact's token times do not depend on it), a mixed step as a prompt step
    at all its tokens, 10% dearer when it also carries decoding requests (as the artifact prices it)."""

    def __init__(self, table: StepTable):
        super().__init__(Parallel(8, 1))
        self.table = table

    def stage_prefill(self, tokens: float, sq: float) -> float:
        return self.table.prompt(tokens)

    def stage_decode_lines(self, batch: float) -> tuple[Line, Line]:
        line = (self.table.token(batch), 0.0)
        return line, line

    def stage_mixed(self, tokens: float, sq: float, batch: float, context: float) -> float:
        if tokens <= 0:
            return self.table.token(batch)
        return self.table.prompt(tokens + batch) * (MIXED_FACTOR if batch > 0 else 1.0)
