"""Decode-attention fast paths equal the general path: length buckets of decode rows
(`attention_context._decode_buckets`) against one padded group, the per-step additive mask against SDPA's
own conversion of the bool mask, and the kept gather workspace against `read_pages`; for raw, int8, fp8
and (through the engine) kivi4 pages."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

import engine.attention_context as ac
from engine import SamplingParams
from engine.attention_context import SeqLayout, build_context
from engine.kv_cache.backend import make_backend
from engine.kv_cache.spec import KVPageSpec
from engine.llm import LLM
from tests.conftest import assert_engine_empty
from tests.exactness import assert_greedy_equal

LENS = [3, 300, 41, 170, 9, 260, 128, 77]  # decode contexts far apart: several buckets


def no_buckets(monkeypatch) -> None:
    monkeypatch.setattr(ac, "_decode_buckets", lambda lens: None)


def test_buckets_cover_every_row_once_sorted_by_length():
    assert ac._decode_buckets([300] * 16) is None  # uniform decode: one group, no mask
    assert ac._decode_buckets([300]) is None
    lens = [64 + 32 * i for i in range(16)]
    random.Random(0).shuffle(lens)
    buckets = ac._decode_buckets(lens)
    assert buckets is not None and len(buckets) > 1
    assert sorted(r for b in buckets for r in b) == list(range(16))
    longest = [max(lens[r] for r in b) for b in buckets]
    assert longest == sorted(longest) and all(min(lens[r] for r in b) >= prev for b, prev in
                                              zip(buckets[1:], longest))


def _filled_backend(fmt: str, page_size: int = 4):
    torch.manual_seed(0)
    spec = KVPageSpec(1, 2, 16, page_size, "float32", fmt)
    pages_per = [-(-n // page_size) for n in LENS]
    b = make_backend(spec, sum(pages_per) + 1)
    free = list(range(1, sum(pages_per) + 1))
    random.Random(1).shuffle(free)  # scattered pages, as after a while of serving
    layouts = []
    for i, (n, p) in enumerate(zip(LENS, pages_per)):
        pages, free = free[:p], free[p:]
        slots = torch.tensor([pages[t // page_size] * page_size + t % page_size for t in range(n)])
        b.write(0, slots, torch.randn(n, 2, 16) * 2, torch.randn(n, 2, 16))
        layouts.append(SeqLayout(f"r{i}", 1, n - 1, pages))  # decode: the last slot is this step's token
    return b, layouts


@pytest.mark.parametrize("fmt", ["raw", "int8", "fp8"])
def test_bucketed_decode_equals_one_padded_group(fmt, monkeypatch):
    b, layouts = _filled_backend(fmt)
    q = torch.randn(len(LENS), 4, 16)  # 4 query heads over 2 KV heads
    ctx = build_context(layouts, 4, 0.25)
    assert len(ctx.groups) > 1 and all(g.token_rows is not None for g in ctx.groups)
    got = b.attend(0, q, ctx)
    no_buckets(monkeypatch)
    one = build_context(layouts, 4, 0.25)
    assert len(one.groups) == 1 and one.groups[0].token_rows is None
    want = b.attend(0, q, one)
    assert torch.allclose(got, want, atol=1e-6), (got - want).abs().max()


def test_mask_bias_equals_the_bool_mask_in_sdpa():
    _, layouts = _filled_backend("raw")
    [g] = build_context([layouts[i] for i in (0, 2, 4)], 4, 0.25).groups  # 3, 41, 9 slots: one group
    assert g.mask is not None
    for dt in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(3, 4, 1, 16, dtype=dt), torch.randn(3, 2, max(g.ctx_lens), 16, dtype=dt),
                   torch.randn(3, 2, max(g.ctx_lens), 16, dtype=dt))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, enable_gqa=True)
        bias = g.mask_bias(dt)
        assert bias is g.mask_bias(dt)  # made once, shared by every layer
        assert torch.equal(a, F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True))


def test_gather_workspace_equals_read_pages_and_is_kept():
    b, layouts = _filled_backend("raw")
    small = build_context(layouts[:2], 4, 0.25).groups[0]
    big = build_context(layouts, 4, 0.25)
    for g in [small, *big.groups, small]:  # shrink, grow, shrink again
        k, v = b._load(0, g)
        rk, rv = b.read_pages(0, g.page_index)
        n = max(g.ctx_lens)
        assert torch.equal(k, rk[:, :n]) and torch.equal(v, rv[:, :n])
    ptr = b._ws[0].data_ptr()
    b._load(0, small)
    assert b._ws[0].data_ptr() == ptr  # no new buffer for a smaller gather


@pytest.mark.parametrize("storage", ["raw", "kivi4"])
def test_engine_tokens_and_logits_with_and_without_buckets(tiny_dir, storage, monkeypatch):
    """Ragged prompts (3..300 tokens) decode together in buckets: the same greedy tokens as one group."""
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (3, 300, 41, 170, 9, 260)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def run():
        llm = LLM(model=str(tiny_dir), dtype="float32", num_pages=256, page_size=4, kv_storage=storage)
        out = [o.token_ids for o in llm.generate(prompts, params)]
        assert_engine_empty(llm)
        return out

    seen = []
    real = ac._decode_buckets
    monkeypatch.setattr(ac, "_decode_buckets", lambda lens: seen.append(real(lens)) or seen[-1])
    got = run()
    assert any(b is not None for b in seen), "no step used buckets: the test lost its point"
    no_buckets(monkeypatch)
    assert_greedy_equal(run(), got)
