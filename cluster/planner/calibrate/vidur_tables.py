"""Measured GPU operator tables in Vidur's CSV layout -> plain rows in seconds; every bad cell is refused
naming its file, row (the line number, header = 1) and column.

    load_tables([paths]) -> Tables        CSV/JSON files, or directories (their *.csv and *.json)

A table's kind is told by its columns (Vidur's profiler writes them; times are in ms, `median` is read):
  compute     mlp.csv: time_stats.<op>.median for the ops in COMPUTE_OPS, per num_tokens and
              num_tensor_parallel_workers; the model's shape in n_head, n_kv_head, n_embd, n_expanded_embd,
              vocab_size, use_gated_mlp
  attention   attention.csv: is_prefill, batch_size, prefill_chunk_size, kv_cache_size (context per
              sequence), n_q_head, n_kv_head, n_embd, num_tensor_parallel_workers and
              time_stats.attn_prefill / attn_decode (/ attn_kv_cache_save, optional).median
  all_reduce  network all_reduce.csv: size (bytes), num_workers, devices_per_node, time_stats.all_reduce.median
  points      JSON extract of an attention.csv (data/gpu_profiles/vidur/*_attention_points.json): its
              key "<gpu>/<model>" names the model; its shape comes from a compute table of that model
              loaded with it (the model name in the table's file name)
Duplicate keys are averaged. All files of one call are taken as measured on one kind of GPU.
Who calls: `gpu_fit` (fit constants), `profiles` (`pdserve plan --profile TABLES`), the GPU check.
"""
from __future__ import annotations

import csv
import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from cluster.planner.errors import BadConfigError

COMPUTE_OPS = ("emb", "input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
               "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
COMPUTE_SHAPE = ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size", "use_gated_mlp")
ATTENTION_KEYS = ("is_prefill", "batch_size", "prefill_chunk_size", "kv_cache_size", "n_q_head", "n_kv_head",
                  "n_embd", "num_tensor_parallel_workers")
ALL_REDUCE_KEYS = ("size", "num_workers", "devices_per_node")


class ProfileTableError(BadConfigError):
    """A measured table is malformed or incomplete; the message names the file, row and column."""


@dataclass(frozen=True)
class LayerShape:
    heads: int
    kv_heads: int
    hidden: int
    ffn: int = 0
    vocab: int = 0
    gated: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass(frozen=True)
class ComputeTable:
    path: str
    shape: LayerShape
    rows: dict[tuple[int, int], dict[str, float]]  # (tp, tokens) -> op -> seconds


@dataclass(frozen=True)
class AttentionTable:
    path: str
    shape: LayerShape
    prefill: dict[tuple[int, int, int], tuple[float, float | None]]  # (tp, chunk, cached) -> (attn, kv save)
    decode: dict[tuple[int, int, int], tuple[float, float | None]]  # (tp, batch, context) -> (attn, kv save)


@dataclass(frozen=True)
class AllReduceTable:
    path: str
    curves: dict[int, list[tuple[float, float]]]  # GPUs (all on one node) -> [(bytes, seconds)] by size


@dataclass
class Tables:
    compute: list[ComputeTable] = field(default_factory=list)
    attention: list[AttentionTable] = field(default_factory=list)
    all_reduce: list[AllReduceTable] = field(default_factory=list)

    @property
    def paths(self) -> list[str]:
        return [t.path for group in (self.compute, self.attention, self.all_reduce) for t in group]


class _Reader:
    """Cells of one CSV with the errors this module promises."""

    def __init__(self, path: Path):
        self.path = path
        try:
            with path.open(newline="") as f:
                rows = list(csv.reader(f))
        except (OSError, UnicodeDecodeError, csv.Error) as e:
            raise ProfileTableError(f"{path}: cannot read as CSV ({e})") from None
        if len(rows) < 2:
            raise ProfileTableError(f"{path}: row 2: no data rows (an empty table)")
        self.header, self.rows = rows[0], rows[1:]
        self.index = {name: i for i, name in enumerate(self.header)}

    def require(self, columns) -> None:
        for col in columns:
            if col not in self.index:
                raise ProfileTableError(f"{self.path}: row 1, column {col!r}: missing from the header")

    def raw(self, line: int, row: list[str], col: str) -> str:
        i = self.index[col]
        if i >= len(row) or row[i].strip() == "":
            raise ProfileTableError(f"{self.path}: row {line}, column {col!r}: empty cell")
        return row[i].strip()

    def number(self, line: int, row: list[str], col: str, positive: bool = True) -> float:
        text = self.raw(line, row, col)
        try:
            v = float(text)
        except ValueError:
            raise ProfileTableError(f"{self.path}: row {line}, column {col!r}: {text!r} is not a number") from None
        if not math.isfinite(v) or v < 0 or (positive and v == 0):
            raise ProfileTableError(f"{self.path}: row {line}, column {col!r}: {text} is not a "
                                    f"{'positive' if positive else 'non-negative'} finite number")
        return v

    def integer(self, line: int, row: list[str], col: str, positive: bool = True) -> int:
        v = self.number(line, row, col, positive)
        if v != int(v):
            raise ProfileTableError(f"{self.path}: row {line}, column {col!r}: {v:g} is not a whole number")
        return int(v)

    def flag(self, line: int, row: list[str], col: str) -> bool:
        text = self.raw(line, row, col).lower()
        if text not in ("true", "false", "1", "0"):
            raise ProfileTableError(f"{self.path}: row {line}, column {col!r}: {text!r} is not true/false")
        return text in ("true", "1")

    def lines(self):
        for n, row in enumerate(self.rows, start=2):
            if any(cell.strip() for cell in row):
                yield n, row


def _ms(col: str) -> str:
    return f"time_stats.{col}.median"


def _averaged(acc: dict) -> dict:
    return {k: (sum(v) / len(v) if not isinstance(v[0], dict) else
                {op: sum(d[op] for d in v) / len(v) for op in v[0]}) for k, v in acc.items()}


def _compute(r: _Reader) -> ComputeTable:
    r.require([_ms(op) for op in COMPUTE_OPS] + list(COMPUTE_SHAPE) + ["num_tokens", "num_tensor_parallel_workers"])
    acc: dict = defaultdict(list)
    shape = None
    for n, row in r.lines():
        s = LayerShape(r.integer(n, row, "n_head"), r.integer(n, row, "n_kv_head"), r.integer(n, row, "n_embd"),
                       r.integer(n, row, "n_expanded_embd"), r.integer(n, row, "vocab_size"),
                       r.flag(n, row, "use_gated_mlp"))
        if shape is not None and s != shape:
            raise ProfileTableError(f"{r.path}: row {n}, column 'n_embd': a second model shape in one table")
        shape = s
        key = (r.integer(n, row, "num_tensor_parallel_workers"), r.integer(n, row, "num_tokens"))
        acc[key].append({op: r.number(n, row, _ms(op)) * 1e-3 for op in COMPUTE_OPS})
    if shape is None:
        raise ProfileTableError(f"{r.path}: row 2: no data rows (an empty table)")
    return ComputeTable(str(r.path), shape, _averaged(acc))


def _attention(r: _Reader) -> AttentionTable:
    r.require(ATTENTION_KEYS)
    save = _ms("attn_kv_cache_save") in r.index
    pre: dict = defaultdict(list)
    dec: dict = defaultdict(list)
    shape = None
    for n, row in r.lines():
        s = LayerShape(r.integer(n, row, "n_q_head"), r.integer(n, row, "n_kv_head"), r.integer(n, row, "n_embd"))
        if shape is not None and s != shape:
            raise ProfileTableError(f"{r.path}: row {n}, column 'n_embd': a second model shape in one table")
        shape = s
        tp, cached = r.integer(n, row, "num_tensor_parallel_workers"), r.integer(n, row, "kv_cache_size", False)
        prefill = r.flag(n, row, "is_prefill")
        col = _ms("attn_prefill" if prefill else "attn_decode")
        if col not in r.index:
            raise ProfileTableError(f"{r.path}: row 1, column {col!r}: missing from the header")
        t = r.number(n, row, col) * 1e-3
        kv = r.number(n, row, _ms("attn_kv_cache_save"), positive=False) * 1e-3 if save else None
        if prefill:
            pre[(tp, r.integer(n, row, "prefill_chunk_size"), cached)].append((t, kv))
        else:
            dec[(tp, r.integer(n, row, "batch_size"), cached)].append((t, kv))
    if shape is None:
        raise ProfileTableError(f"{r.path}: row 2: no data rows (an empty table)")
    mean = lambda v: (sum(a for a, _ in v) / len(v), None if v[0][1] is None else sum(k for _, k in v) / len(v))  # noqa: E731
    return AttentionTable(str(r.path), shape, {k: mean(v) for k, v in pre.items()}, {k: mean(v) for k, v in dec.items()})


def _all_reduce(r: _Reader) -> AllReduceTable:
    r.require(list(ALL_REDUCE_KEYS) + [_ms("all_reduce")])
    acc: dict = defaultdict(list)
    for n, row in r.lines():
        if "collective" in r.index and r.raw(n, row, "collective") != "all_reduce":
            continue
        gpus, per_node = r.integer(n, row, "num_workers"), r.integer(n, row, "devices_per_node")
        if per_node != gpus:  # TP stays inside a node: only single-node rings
            continue
        acc[(gpus, r.number(n, row, "size"))].append(r.number(n, row, _ms("all_reduce")) * 1e-3)
    curves: dict[int, list] = defaultdict(list)
    for (gpus, size), ts in sorted(acc.items()):
        curves[gpus].append((size, sum(ts) / len(ts)))
    if not curves:
        raise ProfileTableError(f"{r.path}: row 2, column 'devices_per_node': no single-node all-reduce rows "
                                f"(devices_per_node == num_workers)")
    return AllReduceTable(str(r.path), dict(curves))


def _points(path: Path, compute: list[ComputeTable]) -> list[AttentionTable]:
    """The JSON extract: {"<gpu>/<model>": {"prefill": {"tp1": {N: [attn_ms, kv_save_ms]}},
    "decode": {"tp1": {context: {batch: [attn_ms, kv_save_ms]}}}}} (keys starting with "_" are notes)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProfileTableError(f"{path}: cannot read as JSON ({e})") from None
    if not isinstance(data, dict):
        raise ProfileTableError(f"{path}: expected a JSON object of \"<gpu>/<model>\" entries")
    out = []
    for key, entry in data.items():
        if key.startswith("_"):
            continue
        model = key.split("/")[-1].lower()
        match = [t for t in compute if model in Path(t.path).name.lower()]
        if not match:
            raise ProfileTableError(f"{path}: entry {key!r}: no compute table of {model} loaded with it (its "
                                    f"file name must contain the model name: the shape comes from there)")
        pre, dec = {}, {}
        try:
            for tp, by_n in entry["prefill"].items():
                for n, (attn, kv) in by_n.items():
                    pre[(int(tp[2:]), int(n), 0)] = (_point(path, key, attn), _point(path, key, kv, False))
            for tp, by_c in entry["decode"].items():
                for ctx, by_b in by_c.items():
                    for b, (attn, kv) in by_b.items():
                        dec[(int(tp[2:]), int(b), int(ctx))] = (_point(path, key, attn), _point(path, key, kv, False))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ProfileTableError(f"{path}: entry {key!r}: not of the form prefill.tpN.TOKENS = [attn_ms, "
                                    f"kv_save_ms], decode.tpN.CONTEXT.BATCH = [...] ({type(e).__name__}: {e})") from None
        out.append(AttentionTable(str(path), match[0].shape, pre, dec))
    return out


def _point(path: Path, key: str, v, positive: bool = True) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise ProfileTableError(f"{path}: entry {key!r}: {v!r} is not a {'positive' if positive else 'non-negative'} "
                                f"time in ms")
    return v * 1e-3


KINDS = (("compute", tuple(_ms(op) for op in COMPUTE_OPS)),  # any of these columns tells the kind
         ("attention", ("is_prefill", _ms("attn_prefill"), _ms("attn_decode"))),
         ("all_reduce", (_ms("all_reduce"),)))


def _files(paths) -> list[Path]:
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(q for q in p.iterdir() if q.suffix in (".csv", ".json"))
        elif p.is_file():
            out.append(p)
        else:
            raise ProfileTableError(f"{p}: no such file or directory")
    if not out:
        raise ProfileTableError(f"{', '.join(map(str, paths))}: no .csv or .json tables found")
    return out


def load_tables(paths) -> Tables:
    """Read every table under `paths`; a CSV of no known kind is refused, naming the columns looked for."""
    tables, points = Tables(), []
    for path in _files(paths):
        if path.suffix == ".json":
            points.append(path)
            continue
        r = _Reader(path)
        kind = next((k for k, cols in KINDS if any(c in r.index for c in cols)), None)
        if kind is None:
            raise ProfileTableError(f"{path}: row 1: not a Vidur compute, attention or all-reduce table (no column "
                                    f"{', '.join(repr(cols[0]) for _, cols in KINDS)})")
        {"compute": tables.compute, "attention": tables.attention, "all_reduce": tables.all_reduce}[kind].append(
            {"compute": _compute, "attention": _attention, "all_reduce": _all_reduce}[kind](r))
    for path in points:
        tables.attention += _points(path, tables.compute)
    return tables
