"""Proposers on their own: n-gram index against a brute-force scan, Token Recycling's matrix, the draft
model's cache rollback, the registry."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine import InvalidRequestError
from engine.spec_decode.proposers import PROPOSERS, DraftState, ProposerContext, make_proposer
from engine.spec_decode.proposers.ngram import NgramProposer
from engine.spec_decode.proposers.recycling import MAX_BYTES, RecyclingProposer
from tests.prompts import MIXED
from tests.tiny_models import write_tiny


def brute_ngram(ids: list[int], k: int, lo: int, hi: int) -> list[int]:
    end = len(ids) - 1
    for n in range(min(hi, end + 1), lo - 1, -1):
        tail = ids[end - n + 1:]
        for e in range(end - 1, n - 2, -1):  # most recent earlier occurrence ending at e
            if ids[e - n + 1:e + 1] == tail:
                return ids[e + 1:e + 1 + k]
    return []


@pytest.mark.parametrize("lo,hi", [(1, 3), (2, 4), (3, 3)])
def test_ngram_index_matches_a_full_scan_as_tokens_arrive(lo, hi):
    rng = random.Random(lo * 10 + hi)
    for case in range(20):
        ids = [rng.randrange(6) for _ in range(5)]
        prop = NgramProposer(None, min_ngram=lo, max_ngram=hi)
        for _ in range(60):
            k = rng.randrange(0, 5)
            got = prop.propose(DraftState(f"r{case}", ids, 2, k))
            assert got == (brute_ngram(ids, k, lo, hi) if k else []), ids
            ids = ids + [rng.randrange(6) for _ in range(rng.randrange(1, 4))]  # several commits at once
        prop.release(f"r{case}")
        assert not prop._index


def test_ngram_prefers_the_longest_then_the_latest_match():
    p = NgramProposer(None, min_ngram=1, max_ngram=3)
    ids = [1, 2, 3, 9, 9, 7, 2, 3, 8, 1, 2, 3]
    assert p.propose(DraftState("a", ids, 0, 2)) == [9, 9]  # "1 2 3" beats the later "2 3"
    assert p.propose(DraftState("b", [5, 1, 7, 1, 8, 1], 0, 3)) == [8, 1]  # latest "1"


def test_recycling_matrix_fits_in_2_mb_for_smollm2_and_drafts_the_best_path():
    big = RecyclingProposer(ProposerContext(49152, Path("."), "float32"))
    assert big.nbytes < MAX_BYTES and big.top == 8
    p = RecyclingProposer(ProposerContext(16, Path("."), "float32"), top=4)
    assert p.propose(DraftState("a", [1, 2], 1, 4)) == []  # nothing learnt yet
    logits = torch.full((3, 16), -5.0)
    logits[0, 5], logits[1, 7], logits[2, 2] = 3.0, 3.0, 3.0  # after 2 -> 5, after 5 -> 7, after 7 -> 2
    p.observe([2, 5, 7], logits)
    assert p.propose(DraftState("a", [1, 2], 1, 4)) == [5, 7, 2, 5]
    assert p.propose(DraftState("a", [1, 7], 1, 2)) == [2, 5]
    assert p.matrix[2, 0] == 5 and p.matrix[3, 0] == -1


def test_draft_model_rolls_its_cache_back_to_what_the_target_committed(tiny_dir):
    ctx = ProposerContext(256, tiny_dir, "float32")
    warm = make_proposer("draft_model", ctx, page_size=2, num_pages=64)
    ids = MIXED[:6]
    first = warm.propose(DraftState("r", ids, 4, 4))
    assert len(first) == 4
    assert warm.tables.get("r").num_slots == len(ids) + 3  # the last draft was never fed
    # The target accepted two drafts and corrected the third: the cache keeps ids + 2 drafts only.
    committed = ids + first[:2] + [(first[2] + 1) % 256]
    again = warm.propose(DraftState("r", committed, 4, 3))
    cold = make_proposer("draft_model", ctx, page_size=2, num_pages=64)
    assert again == cold.propose(DraftState("r", committed, 4, 3))
    for p in (warm, cold):
        p.release("r")
        assert p.kv_usage()["pages_in_use"] == 0


def test_draft_model_stops_drafting_when_its_pool_is_full(tiny_dir):
    p = make_proposer("draft_model", ProposerContext(256, tiny_dir, "float32"), page_size=2, num_pages=4)
    assert p.propose(DraftState("r", list(range(10, 20)), 5, 4)) == []  # 10 tokens need 5 pages
    assert len(p.propose(DraftState("s", [5, 6, 7], 2, 8))) == 6  # 8 slots: 3 tokens + 5 fed drafts + 1
    p.release("s")
    assert p.kv_usage()["pages_in_use"] == 0


def test_registry_and_errors(tiny_dir, tmp_path):
    assert {"ngram", "recycling", "draft_model", "oracle", "always_wrong"} <= set(PROPOSERS)
    ctx = ProposerContext(256, tiny_dir, "float32")
    with pytest.raises(InvalidRequestError, match="unknown proposer"):
        make_proposer("medusa", ctx)
    with pytest.raises(InvalidRequestError, match="proposer_options"):
        make_proposer("ngram", ctx, n=3)
    other = write_tiny("llama", tmp_path / "v128", vocab_size=128)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        make_proposer("draft_model", ctx, model=str(other))
