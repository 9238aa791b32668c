"""The exactness rules themselves (`tests.exactness`): a near-tie is tolerated, a real divergence fails, and the
teacher-forced check compares every position (a near-tie does not end its case)."""
from __future__ import annotations

import pytest
import torch

from tests.exactness import assert_greedy_equal, assert_greedy_forced


def _logits(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_forced_accepts_argmax_and_a_near_tie_then_keeps_comparing():
    lg = _logits([[0.0, 5.0, 1.0], [2.0, 2.0 - 5e-5, 0.0], [0.0, 0.0, 3.0]])
    rep = assert_greedy_forced([[1, 1, 2]], [lg])  # position 1: the runner-up by 5e-5, a near-tie
    assert rep.compared == 3 and [(c, p) for c, p, _ in rep.divergences] == [(0, 1)]
    with pytest.raises(AssertionError, match="position 2"):  # after the near-tie: still compared
        assert_greedy_forced([[1, 1, 0]], [lg])


def test_forced_refuses_a_real_divergence_and_too_many_near_ties():
    lg = _logits([[0.0, 5.0, 1.0]])
    with pytest.raises(AssertionError, match="not a near-tie"):
        assert_greedy_forced([[2]], [lg])
    tie = _logits([[1.0, 1.0 - 1e-5]] * 4)
    with pytest.raises(AssertionError, match="too many"):  # two near-ties in 4 tokens: 1 allowed
        assert_greedy_forced([[1, 1, 0, 0]], [tie])
    with pytest.raises(AssertionError, match="reference rows"):
        assert_greedy_forced([[1, 1]], [lg])


def test_generate_rule_stops_a_case_at_its_near_tie():
    lg = _logits([[1.0, 1.0 - 1e-5], [0.0, 9.0]])
    rep = assert_greedy_equal([[0, 1]], [[1, 0]], [lg])  # diverged at 0 (near-tie): the rest not compared
    assert rep.compared == 1 and len(rep.divergences) == 1
