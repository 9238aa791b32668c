"""Dense decode copies (`engine/kv_cache/dense_decode.py`) equal the page gather they replace: step by step
in the backend (continue, grow past the copy, a row leaving, pages replaced, a rewrite at the same length)
and through the engine (tokens and float32 logits, with buckets, chunked prefill and preemption)."""
from __future__ import annotations

import random

import pytest
import torch

import engine.kv_cache.dense_decode as dd
from engine import SamplingParams
from engine.attention_context import SeqLayout, build_context
from engine.kv_cache.backend import RawKVBackend, make_backend
from engine.kv_cache.spec import KVPageSpec
from engine.llm import LLM
from tests.conftest import assert_engine_empty
from tests.exactness import assert_greedy_equal

PS = 4


class Twin:
    """The same pages in two backends, one with dense copies and one without; every step compares."""

    def __init__(self, num_pages: int = 64):
        spec = KVPageSpec(2, 2, 16, PS, "float32", "raw")
        self.on, self.off = make_backend(spec, num_pages), make_backend(spec, num_pages)
        self.off.dense_decode = False
        self.lens: dict[str, int] = {}
        self.pages: dict[str, list[int]] = {}
        self.free = list(range(1, num_pages))
        random.Random(0).shuffle(self.free)

    def _slots(self, rid: str, start: int, n: int) -> torch.Tensor:
        pages = self.pages.setdefault(rid, [])
        while len(pages) * PS < start + n:
            pages.append(self.free.pop())
        return torch.tensor([pages[t // PS] * PS + t % PS for t in range(start, start + n)])

    def prefill(self, rid: str, n: int) -> None:
        for b in (self.on, self.off):
            torch.manual_seed(len(self.lens))
            for layer in range(2):
                b.write(layer, self._slots(rid, 0, n), torch.randn(n, 2, 16), torch.randn(n, 2, 16))
        self.lens[rid] = n

    def decode(self, rids: list[str], via_pool: bool = False) -> None:
        """One decode step of `rids` (one new slot each) on both backends; outputs must be equal.
        via_pool: write with another slots tensor, so a continuing copy reads its new rows from the pages."""
        for r in rids:
            self._slots(r, self.lens[r], 1)  # a page for the new slot when the last one is full
        layouts = [SeqLayout(r, 1, self.lens[r], self.pages[r]) for r in rids]
        ctx_on, ctx_off = (build_context(layouts, PS, 0.25) for _ in range(2))
        slots = ctx_on.write_slots.clone() if via_pool else ctx_on.write_slots
        for layer in range(2):
            k, v, q = torch.randn(len(rids), 2, 16), torch.randn(len(rids), 2, 16), torch.randn(len(rids), 4, 16)
            self.on.write(layer, slots, k, v)
            self.off.write(layer, slots, k, v)
            got, want = self.on.attend(layer, q, ctx_on), self.off.attend(layer, q, ctx_off)
            assert torch.equal(got, want), (got - want).abs().max()
        for r in rids:
            self.lens[r] += 1


@pytest.fixture(autouse=True)
def every_group(monkeypatch):
    """Tiny groups: copy them all (the size floor is a speed choice, not a correctness one)."""
    monkeypatch.setattr(dd, "MIN_GROUP_BYTES", 0)


def spy(monkeypatch) -> dict[str, int]:
    counts = {"fill": 0, "continue": 0}
    fill, cont = dd.DenseDecode._fill, dd.DenseDecode._continue

    def _fill(self, *a):
        counts["fill"] += 1
        return fill(self, *a)

    def _continue(self, *a):
        ok = cont(self, *a)
        counts["continue"] += ok
        return ok

    monkeypatch.setattr(dd.DenseDecode, "_fill", _fill)
    monkeypatch.setattr(dd.DenseDecode, "_continue", _continue)
    return counts


def test_steps_continue_and_refill_when_the_chain_breaks(monkeypatch):
    counts = spy(monkeypatch)
    t = Twin()
    for rid, n in (("a", 10), ("b", 7), ("c", 13)):
        t.prefill(rid, n)
    t.decode(["a", "b", "c"])
    assert counts == {"fill": 1, "continue": 0}
    for i in range(dd.GROW_SLOTS + 3):  # grows past the copy's room once: one more fill
        t.decode(["a", "b", "c"], via_pool=i % 2 == 1)
    assert counts["fill"] == 2 and counts["continue"] == dd.GROW_SLOTS + 2
    t.decode(["a", "c"])  # a row left: a new group, a fill
    assert counts["fill"] == 3
    t.decode(["a", "c"])
    assert counts["continue"] == dd.GROW_SLOTS + 3
    # c's KV moves to other pages (as after preemption and recompute): same ids, same growth, new pages
    old = t.pages.pop("c")
    t.prefill("c", t.lens["c"])
    assert t.pages["c"] != old
    t.decode(["a", "c"])
    assert counts["fill"] == 4
    # a rewrite at the same length (a rolled-back slot written again): not a continuation
    t.lens["a"] -= 1
    t.lens["c"] -= 1
    t.decode(["a", "c"])
    assert counts["fill"] == 5


def test_single_rows_small_groups_and_other_formats_take_the_gather_path(monkeypatch):
    t = Twin()
    t.prefill("a", 9)
    t.decode(["a"])
    assert not t.on._dense.mirrors
    t.prefill("b", 5)
    monkeypatch.setattr(dd, "MIN_GROUP_BYTES", 1 << 20)  # 2 rows x 11 slots: far below
    t.decode(["a", "b"])
    assert not t.on._dense.mirrors
    spec = KVPageSpec(1, 2, 16, PS, "float32", "int8")
    assert make_backend(spec, 8)._dense_for() is None
    assert RawKVBackend(KVPageSpec(1, 2, 16, PS, "float32", "raw"), 8)._dense_for() is not None


def test_engine_tokens_and_logits_equal_with_and_without_dense_copies(tiny_dir, monkeypatch):
    """Ragged prompts with staggered finishes, chunked prefill and preemption (few pages)."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (5, 90, 41, 170, 9, 60)]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (20, 12, 30, 8, 25, 16)]

    def run(dense: bool):
        monkeypatch.setattr(RawKVBackend, "dense_decode", dense)
        llm = LLM(model=str(tiny_dir), dtype="float32", num_pages=90, page_size=4, keep_logits=True,
                  max_num_batched_tokens=64)
        outs = llm.generate(prompts, params)
        assert_engine_empty(llm)
        return outs, llm.scheduler.stats

    counts = spy(monkeypatch)
    got, stats = run(True)
    assert counts["continue"] > 10 and counts["fill"] > 0, counts
    assert stats.num_preemptions > 0 and stats.num_chunked_prefills > 0, stats
    want, _ = run(False)
    assert_greedy_equal([o.token_ids for o in want], [o.token_ids for o in got])
    for a, b in zip(got, want):
        assert torch.equal(torch.stack(a.logits), torch.stack(b.logits))
