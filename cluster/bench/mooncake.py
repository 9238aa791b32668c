"""The Mooncake conversation trace: rows with prefix-block ids, and whole-conversation sampling.

Called by `cluster.bench.workload.trace` (rows) and `load_workload` (`--workload mooncake:sessions=N`).
Each row's `hash_ids` names its prompt's 512-token blocks; equal ids mean equal content, so a later turn
of a conversation repeats the earlier turns' blocks (a prefix a cache can reuse). `prompts.PromptSource`
turns the ids back into token blocks (scaled to `TraceScaling.block()` tokens each).

Why sessions: the trace spans an hour and 12,031 requests, and a conversation's turns are minutes
apart, so any contiguous slice a CPU can replay (a few hundred rows, about a minute) sees little reuse
(first 200 rows: 6% of blocks seen before, against 37% over the whole hour). `sessions=N` keeps whole
conversations instead: the first N conversations (rows grouped by their first two block ids, the first
block being a system prompt all rows share) with at least `min_turns` rows, every row of each, in trace
order and with the trace's own gaps between them. The arrival pattern inside a conversation is kept; the
number of concurrent conversations is what is thinned (stated in the output JSON).
"""
from __future__ import annotations

import json
from pathlib import Path

Row = tuple[float, int, int, tuple[int, ...]]  # (arrival s, input tokens, output tokens, block ids)


class MooncakeError(ValueError):
    """A Mooncake trace line or sampling option that cannot be used."""


def _parse(path: Path, i: int, line: str) -> Row:
    try:
        d = json.loads(line)
        blocks = tuple(int(h) for h in d.get("hash_ids", ()))
        return d["timestamp"] / 1000.0, int(d["input_length"]), int(d["output_length"]), blocks
    except (ValueError, KeyError, TypeError) as e:
        raise MooncakeError(f"{path}:{i + 1}: not a Mooncake trace line ({e})") from None


def read_rows(path: Path, start: int, n: int, stride: int) -> list[Row]:
    """Rows start, start + stride, ... (n of them)."""
    rows: list[Row] = []
    with path.open() as f:
        for i, line in enumerate(f):
            if i < start or (i - start) % stride or not line.strip():
                continue
            if len(rows) >= n:
                break
            rows.append(_parse(path, i, line))
    return rows


def session_key(row: Row) -> tuple[int, ...]:
    return row[3][:2]


def read_sessions(path: Path, start: int, n: int, num_sessions: int, min_turns: int = 2) -> list[Row]:
    """Every row of the first `num_sessions` conversations (from row `start` on) that have at least
    `min_turns` rows, in trace order; at most `n` rows."""
    if num_sessions < 1 or min_turns < 1:
        raise MooncakeError(f"need sessions >= 1 and min_turns >= 1, got {num_sessions}, {min_turns}")
    with path.open() as f:
        rows = [_parse(path, i, line) for i, line in enumerate(f) if i >= start and line.strip()]
    turns: dict[tuple[int, ...], int] = {}
    for r in rows:
        turns[session_key(r)] = turns.get(session_key(r), 0) + 1
    chosen: dict[tuple[int, ...], None] = {}  # first appearance order
    for r in rows:
        k = session_key(r)
        if turns[k] >= min_turns and len(chosen) < num_sessions:
            chosen.setdefault(k, None)
    return [r for r in rows if session_key(r) in chosen][:n]


def block_hit_rate(block_ids: list[tuple[int, ...]]) -> float:
    """Fraction of blocks that an earlier request already sent (an upper bound for a prefix cache)."""
    seen: set[int] = set()
    hits = total = 0
    for ids in block_ids:
        for h in ids:
            hits += h in seen
            total += 1
            seen.add(h)
    return hits / total if total else 0.0
