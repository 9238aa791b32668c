"""cluster/bench/mooncake.py and the block prompts of prompts.py: Mooncake requests share exactly the
prefixes their `hash_ids` say, whole conversations can be sampled, and rounds never share prompts."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.bench.mooncake import block_hit_rate
from cluster.bench.prompts import PromptSource
from cluster.bench.workload import TRACES, TraceScaling, WorkloadError, load_workload, workloads_dir

DATA = Path(__file__).resolve().parents[2] / "data" / "workloads"  # the repository's traces


class WordTokenizer:
    def encode(self, text):
        return [ord(ch) for ch in text]

    def decode(self, ids):
        return "".join(map(chr, ids))


@pytest.fixture(autouse=True)
def traces(monkeypatch):
    monkeypatch.delenv("PDSERVE_WORKLOADS", raising=False)
    assert workloads_dir() == DATA and all((DATA / f).is_file() for f in TRACES.values())


def _trace(tmp_path, rows) -> Path:
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(json.dumps(dict(timestamp=t, input_length=n, output_length=5, hash_ids=h))
                           for t, n, h in rows) + "\n")
    return p


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_equal_block_ids_give_equal_token_blocks(tmp_path):
    path = _trace(tmp_path, [(0, 1100, [0, 1, 2]), (10, 1500, [0, 1, 3]), (20, 600, [0, 4]), (30, 512, [5])])
    w = load_workload(str(path), 10, scaling=TraceScaling(0.25, 1.0))
    assert w.block_tokens == 128 and w.info["block_tokens"] == 128
    reqs = w.at_rate(1.0)
    assert [r.block_ids for r in reqs] == [(0, 1, 2), (0, 1, 3), (0, 4), (5,)]
    src = PromptSource(WordTokenizer())
    p = [src.prompt(r, w.block_tokens) for r in reqs]
    assert [len(x) for x in p] == [275, 375, 150, 128]  # scaled input lengths, exactly
    assert _common_prefix(p[0], p[1]) == 256  # two shared blocks, then different third blocks
    assert _common_prefix(p[0], p[2]) == 128  # the shared first block only
    assert _common_prefix(p[0], p[3]) < 16  # nothing shared (beyond a chance token or two)
    assert w.info["block_hit_rate"] == pytest.approx(3 / 9)


def test_rounds_never_share_prompts_but_keep_sharing_within_a_round(tmp_path):
    path = _trace(tmp_path, [(0, 1024, [0, 1]), (1, 1024, [0, 1])])
    w = load_workload(str(path), 10)
    src = PromptSource(WordTokenizer())
    r0, r1 = w.at_rate(1.0, round_no=0), w.at_rate(1.0, round_no=1)
    assert src.prompt(r0[0], w.block_tokens) == src.prompt(r0[1], w.block_tokens)
    assert _common_prefix(src.prompt(r0[0], w.block_tokens), src.prompt(r1[0], w.block_tokens)) < 16
    # plain (block-less) prompts: round 0 is unchanged, other rounds differ
    assert src.ids(3, 50) == src.ids(3, 50, round_no=0) != src.ids(3, 50, round_no=2)


def test_sessions_keep_whole_conversations(tmp_path):
    rows = [(0, 600, [0, 1]), (1, 600, [0, 2]), (2, 900, [0, 1, 3]), (3, 700, [0, 4]),
            (4, 1300, [0, 1, 3, 5]), (5, 900, [0, 4, 6]), (6, 600, [0, 7]), (7, 900, [0, 7, 8])]
    path = _trace(tmp_path, rows)
    w = load_workload(f"{path}:sessions=2", 100)
    assert [r.block_ids for r in w.at_rate(1.0)] == [(0, 1), (0, 1, 3), (0, 4), (0, 1, 3, 5), (0, 4, 6)]
    assert w.info["sessions"] == 2 and "whole conversations" in w.info["sampling"]
    one = load_workload(f"{path}:sessions=10,min_turns=3", 100)
    assert [r.block_ids[:2] for r in one.at_rate(1.0)] == [(0, 1)] * 3
    # more reuse than the contiguous slice of the same rows
    assert w.info["block_hit_rate"] > load_workload(str(path), 5).info["block_hit_rate"]


def test_mooncake_trace_sessions_and_errors(tmp_path):
    w = load_workload("mooncake:sessions=3", 50)
    assert len(w) >= 6 and w.block_ids is not None and len(w.block_ids) == len(w)
    # conversations repeat their earlier turns: several times the reuse of a contiguous slice as long
    # (full trace: 0.34 vs 0.04)
    assert block_hit_rate(w.block_ids) > 3 * block_hit_rate(load_workload("mooncake", len(w)).block_ids)
    plain = load_workload("mooncake", 20)
    assert plain.block_ids is not None and plain.at_rate(1.0)[0].block_ids[0] == 0
    assert load_workload("azure-code", 5).block_ids is None
    with pytest.raises(WorkloadError, match="unknown option"):
        load_workload("mooncake:session=3", 5)
    with pytest.raises(WorkloadError, match="sessions >= 1"):
        load_workload("mooncake:min_turns=2", 5)
    with pytest.raises(WorkloadError, match="needs a Mooncake trace"):
        load_workload("azure-code:sessions=2", 5)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": "x"}\n')
    with pytest.raises(WorkloadError, match="not a Mooncake trace line"):
        load_workload(str(bad), 5)
