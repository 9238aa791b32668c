"""bench/repro/splitwise/step_table.py: the artifact's iteration-time tables as a latency model (issue 26, the
paper's own inputs), and SlowdownSLO's TBT over all output tokens (splitwise-sim's definition)."""
from __future__ import annotations

import pytest

from bench.repro.splitwise.slo import SlowdownSLO
from bench.repro.splitwise.step_table import StepTable, StepTableError, TableLatency, interp_extrapolated
from cluster.planner.sim.metrics import RequestResult


def test_interpolates_between_points_and_extrapolates_linearly_past_both_ends():
    xs, ys = (128.0, 256.0, 512.0), (10.0, 20.0, 60.0)
    assert interp_extrapolated(xs, ys, 192) == pytest.approx(15.0)
    assert interp_extrapolated(xs, ys, 64) == pytest.approx(5.0)  # the first segment's slope, continued
    assert interp_extrapolated(xs, ys, 1024) == pytest.approx(140.0)  # the last segment's slope
    assert interp_extrapolated(xs, ys, 256) == pytest.approx(20.0)


def test_bundled_tables_load_in_seconds_and_the_model_reads_them_as_the_artifact_does():
    t = StepTable.load("bloom-176b", "splitwise-a100")
    assert t.prompt(1024) == pytest.approx(0.28747)
    lm = TableLatency(t)
    # decode: by batch size only, no context term
    assert lm.decode(1, 100) == lm.decode(1, 100_000) == pytest.approx(t.token(1))
    # a mixed iteration is a prompt iteration at prompt tokens + one per decoding request, 10% dearer
    assert lm.mixed(1000, 1e6, 24, 50_000) == pytest.approx(1.1 * t.prompt(1024))
    assert lm.mixed(1000, 1e6, 0, 0) == pytest.approx(t.prompt(1000))  # prompts alone: no surcharge
    assert lm.prefill(2048, 0) == pytest.approx(0.53606)
    h = StepTable.load("llama-2-70b", "splitwise-h100cap")
    assert h.prompt(2048) > StepTable.load("llama-2-70b", "splitwise-h100").prompt(2048)  # power-capped prompts


def test_missing_or_malformed_tables_are_typed_errors(tmp_path):
    with pytest.raises(StepTableError, match="no table for model 'opt-13b'"):
        StepTable.load("opt-13b", "splitwise-a100")
    bad = tmp_path / "t.yaml"
    bad.write_text("tables: {m: {h: {batch_tokens: [2, 1], prompt_ms: [1, 2], token_ms: [1, 2]}}}")
    with pytest.raises(StepTableError, match="must rise"):
        StepTable.load("m", "h", bad)


def test_tbt_over_all_tokens_divides_by_every_output_token():
    r = RequestResult(0.0, 0.1, 0.05, 0.1 + 0.05 * 9, 100, 10)  # 9 gaps of 50 ms after the first token
    per_gap = SlowdownSLO(1.0, 1.0, alone_ttft=lambda n: 0.1, alone_tbt=lambda n: 0.05)
    artifact = SlowdownSLO(1.0, 1.0, alone_ttft=lambda n: 0.1, alone_tbt=lambda n: 0.05, tbt_over_all_tokens=True)
    assert per_gap.slowdowns([r], "tbt") == [pytest.approx(1.0)]
    assert artifact.slowdowns([r], "tbt") == [pytest.approx(0.9)]
