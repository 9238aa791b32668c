"""Adaptive draft length, the cost model and the load-aware gate (pure Python), and the gate in the engine."""
from __future__ import annotations

import pytest

from engine import InvalidRequestError, SamplingParams
from engine.llm import LLM
from engine.spec_decode import SpeculativeConfig
from engine.spec_decode.policy import (AcceptanceTracker, CostModel, SpecStats, VerifyScale, choose_lengths,
                                      critical_shares, expected_tokens)
from tests.conftest import assert_engine_empty


def test_draft_length_follows_acceptance_but_always_asks_for_one():
    tr = AcceptanceTracker(alpha=0.95)
    assert tr.draft_len(4, 0.3) == 4
    tr = AcceptanceTracker(alpha=0.6)
    assert tr.draft_len(8, 0.3) == 2  # 0.6, 0.36 >= 0.3 > 0.216
    for _ in range(10):
        tr.update(drafted=2, accepted=0)
    assert tr.alpha < 0.1
    assert tr.draft_len(4, 0.3) == 1, "whether one draft pays is the gate's call"
    assert tr.draft_len(0, 0.3) == 0
    for _ in range(10):
        tr.update(drafted=4, accepted=4)
    assert tr.draft_len(4, 0.3) == 4


def test_expected_tokens_is_geometric():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_cost_model_fits_a_line_and_falls_back_to_the_prior_without_spread():
    cm = CostModel(decay=1.0)
    assert cm.predict(32) / cm.predict(0) == pytest.approx(2.0)  # prior: 32 tokens cost one intercept
    for n in (1, 2, 4, 8, 16, 1, 5, 9):
        cm.observe(n, 0.030 + 0.002 * n)
    a, b = cm.fit()
    assert a == pytest.approx(0.030, rel=1e-6) and b == pytest.approx(0.002, rel=1e-6)
    flat = CostModel()
    for _ in range(5):
        flat.observe(4, 0.036)
    a, b = flat.fit()
    assert a + 4 * b == pytest.approx(0.036) and b == pytest.approx(a / 32)


def _cost(a, b):
    cm = CostModel(decay=1.0)
    for n in (1, 3, 8, 20, 40):
        cm.observe(n, a + b * n)
    return cm


def test_gate_speculates_when_memory_bound_and_not_when_compute_bound():
    memory_bound, compute_bound = _cost(0.030, 0.0005), _cost(0.0001, 0.002)
    lens, ratio = choose_lengths(memory_bound, 1, [4], [0.8], margin=0.02)
    assert lens == [4] and ratio < 1.1
    assert choose_lengths(compute_bound, 1, [4], [0.8], margin=0.02)[0] == [0]
    assert choose_lengths(memory_bound, 1, [4], [0.01], margin=0.02)[0] == [0]  # drafts that almost never land
    assert choose_lengths(memory_bound, 1, [4], [0.8], margin=0.02, draft_cost_per_token=0.05)[0] == [0]
    assert choose_lengths(memory_bound, 1, [], [], margin=0.02) == ([], 1.0)


def test_gate_drafts_less_under_load_and_more_where_drafts_land():
    cm = _cost(0.030, 0.002)
    alone = choose_lengths(cm, 1, [8], [0.7], margin=0.02)[0]
    assert alone == [5]  # gains 0.7^j against a marginal cost that grows with the rate
    busy = choose_lengths(cm, 32, [8] * 32, [0.7] * 32, margin=0.02)[0]
    assert max(busy) < alone[0]
    mixed = choose_lengths(cm, 4, [8] * 4, [0.9, 0.9, 0.2, 0.2], margin=0.02)[0]
    assert mixed[0] == mixed[1] > mixed[2] == mixed[3]


def test_gate_weighs_drafts_against_the_whole_batch_rate():
    cm = _cost(0.030, 0.002)  # a 16-row step: 62 ms; a draft token: 2 ms
    # Two drafters alone: an accepted token is worth a/2 + b = 17 ms, a draft at 0.4 pays (0.4 x 17 > 2).
    assert choose_lengths(cm, 2, [4, 4], [0.4, 0.4], margin=0.02)[0] != [0, 0]
    # The same two among 16 rows: worth a/16 + b = 3.9 ms, 0.4 x 3.9 < 2: plain decoding.
    lens, ratio = choose_lengths(cm, 16, [4, 4], [0.4, 0.4], margin=0.02, rows=16)
    assert lens == [0, 0] and ratio > 1.0
    # Drafts that land often still pay at batch 16 (0.9 x 3.9 > 2).
    assert choose_lengths(cm, 16, [4, 4], [0.9, 0.9], margin=0.02, rows=16)[0][0] > 0


def test_stats_ratios():
    st = SpecStats(num_steps=10, num_spec_steps=4, num_verifies=8, num_drafted=20, num_accepted=10, num_emitted=18)
    d = st.as_dict()
    assert (d["acceptance_rate"], d["tokens_per_verify"], d["spec_share"]) == (0.5, 2.25, 0.4)
    assert SpecStats().as_dict()["acceptance_rate"] == 0.0


def test_config_validation():
    assert SpeculativeConfig.of(None) is None
    cfg = SpeculativeConfig.of({"proposer": "recycling", "max_draft": 3})
    assert (cfg.proposer, cfg.max_draft) == ("recycling", 3)
    with pytest.raises(InvalidRequestError, match="speculative.max_drafts"):
        SpeculativeConfig.of({"max_drafts": 3})
    with pytest.raises(InvalidRequestError, match="speculative.proposer"):
        SpeculativeConfig(proposer="medusa")
    with pytest.raises(InvalidRequestError, match="speculative.max_draft"):
        SpeculativeConfig(max_draft=0)


class ComputeBound(CostModel):
    """A fake cost model: every token costs the same, nothing is fixed (speculation never pays)."""

    def observe(self, num_tokens, seconds):
        pass

    def predict(self, num_tokens):
        return float(num_tokens)


def test_engine_gate_turns_speculation_off_when_it_does_not_pay(tiny_dir):
    prompt = [5, 6, 7, 8] * 6
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = LLM(model=str(tiny_dir), dtype="float32", num_pages=64)
    ref = plain.generate(prompt, params)[0].token_ids
    fut = {tuple(prompt): ref}
    llm = LLM(model=str(tiny_dir), dtype="float32", num_pages=64,
              speculative={"proposer": "oracle", "proposer_options": {"futures": fut}})
    llm.spec.cost = ComputeBound()
    assert llm.generate(prompt, params)[0].token_ids == ref
    st = llm.spec.stats
    assert st.num_spec_steps == 0 and st.num_gated > 0 and st.verify_cost_ratio > 1.0
    llm.spec.cost = CostModel()  # the prior (memory-bound decode): speculation pays with an oracle
    assert llm.generate(prompt, params)[0].token_ids == ref
    assert llm.spec_stats()["num_spec_steps"] > 0
    assert_engine_empty(plain)
    assert_engine_empty(llm)


def test_verify_scale_learns_draft_token_cost_and_relaxes_when_refused():
    vs = VerifyScale()
    for _ in range(40):  # drafted steps: 8 draft tokens cost 24 ms over a 100 ms plain step, b = 1 ms
        vs.observe(0.124, 0.100, 0.001, 8)
    assert vs.value == pytest.approx(3.0, rel=0.01)
    cm = _cost(0.030, 0.001)
    # At 3 rows' cost per draft token, a draft at 0.5 no longer pays at batch 16 (0.5 x 2.9 ms < 3 ms)...
    assert choose_lengths(cm, 16, [4] * 16, [0.5] * 16, margin=0.02, rows=16, verify_scale=vs.value)[0] == [0] * 16
    # ...while at the prior (a draft token costs a row) it did.
    assert any(choose_lengths(cm, 16, [4] * 16, [0.5] * 16, margin=0.02, rows=16)[0])
    for _ in range(200):
        vs.refused()
    assert vs.value == pytest.approx(1.0, abs=0.1)  # retried after a long refusal
    vs.observe(0.05, 0.100, 0.001, 8)  # a faster-than-plain reading counts as free, not negative
    assert vs.value >= 0.0


def test_drain_drafts_pay_only_in_rows_off_the_critical_path():
    cm = _cost(0.030, 0.002)  # a = 30 ms, a row 2 ms; a 16-row step 62 ms
    # Slots are refilled (fixed_share None): an accepted token is worth a/16 + b = 3.9 ms > 2 ms / 0.7.
    assert any(choose_lengths(cm, 16, [4] * 4, [0.7] * 4, margin=0.02, rows=16)[0])
    # Draining, these four off the critical path: an accepted token saves only its row (0.7 x 2 < 2).
    lens, ratio = choose_lengths(cm, 16, [4] * 4, [0.7] * 4, margin=0.02, rows=16, fixed_share=[0.0] * 4)
    assert lens == [0] * 4 and ratio > 1.0
    # ...unless a draft token is cheap beside a row (a measured scale of 0.3: 0.7 x 2 > 0.6 ms).
    assert any(choose_lengths(cm, 16, [4] * 4, [0.7] * 4, margin=0.02, rows=16, verify_scale=0.3,
                              fixed_share=[0.0] * 4)[0])
    # The lone critical request saves whole steps: a + b = 32 ms per accepted token.
    lens, _ = choose_lengths(cm, 16, [4, 4], [0.6, 0.6], margin=0.02, rows=16, fixed_share=[1.0, 0.0])
    assert lens[0] == 4 and lens[1] == 0


def test_drain_keeps_drafting_a_copy_batch_with_one_request_ahead_and_one_without_a_draft():
    """Issue 25: copy-heavy at 4 concurrent speculated in 41% of steps at 0.77 acceptance. Four requests of
    equal budget draining (none waits); `a` speculated 6 tokens ahead, `d` has no n-gram match this step.
    The old rule (critical = within one draft of the longest budget, and a share only when every critical
    request drafts) gave every draft the worth of its row alone, and the gate refused them all."""
    cm = _cost(0.030, 0.001)  # a = 30 ms, a row 1 ms
    left = {"a": 120, "b": 126, "c": 126, "d": 126}
    rate = expected_tokens(0.77, 4)  # the longest request's tokens per step while it speculates: 3.2
    shares = critical_shares(left, ["a", "b", "c"], rate, slack=8)
    assert shares == [0.25] * 3  # all four finish together at this pace: each token saves 1/4 of a step
    lens, ratio = choose_lengths(cm, 4, [4, 4, 4], [0.77] * 3, margin=0.05, rows=4, fixed_share=shares)
    assert lens == [4, 4, 4] and ratio > 1.0
    old = choose_lengths(cm, 4, [4, 4, 4], [0.77] * 3, margin=0.05, rows=4, fixed_share=[0.0] * 3)
    assert old[0] == [0, 0, 0]  # what the old shares decided: 0.77 x 1 ms < 1 ms per draft token


def test_critical_set_is_who_outlasts_the_longest_at_its_pace():
    rate = expected_tokens(0.77, 4)
    # 10 tokens left is done before the longest's ~31 speculative steps: its tokens save rows only
    assert critical_shares({"short": 10, "long": 100}, ["short", "long"], rate, slack=8) == [0.0, 1.0]
    assert critical_shares({"short": 40, "long": 100}, ["short", "long"], rate, slack=8) == [0.5, 0.5]
    # the longest does not speculate (rate 1): only those within one draft of it
    assert critical_shares({"x": 95, "y": 91, "top": 100}, ["x", "y"], 1.0, slack=8) == [0.5, 0.0]
