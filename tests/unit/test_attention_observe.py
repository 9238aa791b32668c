"""`AttentionContext.observe_attention` (engine/attention_context.py), the statistics SnapKV and H2O evict
by, held to a plain oracle: the whole [Hq, q, n] float32 softmax with K repeated per query head (the
implementation before it was chunked). Shapes are small and random, with grouped-query heads, causal
groups, explicit masks (cached slots, sliding windows, a batch of unequal lengths), windows longer than the
query, bf16 inputs, and chunks of a few query rows so every chunk boundary is crossed."""
from __future__ import annotations

import pytest
import torch

import engine.attention_context as ac
from engine.attention_context import ObserveSpec, SeqLayout, build_context

BOTH = ObserveSpec(window=5, slot_mass=True)


def reference(ctx, g, qh, kh) -> dict:
    """The oracle: every head, every query, the full mask; what the statistics mean."""
    rep, out = qh.shape[1] // kh.shape[1], {}
    for row, spec in g.observe.items():
        n = g.ctx_lens[row]
        k = kh[row, :, :n].repeat_interleave(rep, dim=0)  # [Hq, n, D]
        scores = (qh[row].float() @ k.float().transpose(-1, -2)) * ctx.scale  # [Hq, q, n]
        if g.mask is not None:
            scores = scores.masked_fill(~g.mask[row, :, :, :n], float("-inf"))
        elif g.is_causal:
            scores = scores.masked_fill(~torch.ones(g.q_len, n, dtype=torch.bool).tril(n - g.q_len), float("-inf"))
        probs = scores.softmax(-1)
        rec = out.setdefault(g.request_ids[row], {})
        if spec.window:
            rec["window"] = probs[:, -spec.window:].mean(0)
        if spec.slot_mass:
            rec["slot_mass"] = probs.sum((0, 1))
    return out


def observed(seqs, spec_of, heads=6, kv_heads=2, dim=8, window=None, dtype=torch.float32, seed=0):
    """Both implementations over every group of a step built from `seqs`: [(request, stat, new, oracle)]."""
    gen = torch.Generator().manual_seed(seed)
    ctx = build_context(seqs, 4, dim ** -0.5, sliding_window=window, observe=spec_of)
    pairs = []
    for g in ctx.groups:
        if not g.observe:
            continue
        n = max(g.ctx_lens)
        qh = torch.randn(g.batch, heads, g.q_len, dim, generator=gen).to(dtype)
        kh = (torch.randn(g.batch, kv_heads, n, dim, generator=gen) * 2).to(dtype)
        ctx.observe_attention(3, g, qh, kh)
        want = reference(ctx, g, qh, kh)
        for rid, stats in want.items():
            got = ctx.observations[(rid, 3)]
            assert set(got) == set(stats)
            pairs += [(rid, name, got[name], stats[name]) for name in stats]
    assert pairs
    return pairs


def assert_same(pairs):
    for rid, name, got, want in pairs:
        assert got.dtype == torch.float32 and got.shape == want.shape, (rid, name, got.shape, want.shape)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"{rid} {name}")


@pytest.fixture(params=[1 << 18, 100], ids=["one-chunk", "chunks-of-few-rows"])
def chunk(request, monkeypatch):
    monkeypatch.setattr(ac, "OBSERVE_CHUNK_ELEMS", request.param)  # 100 // (6 heads * n): 1-2 rows a chunk


@pytest.mark.parametrize("spec", [BOTH, ObserveSpec(window=40), ObserveSpec(slot_mass=True), ObserveSpec(window=1)])
def test_causal_prefill_matches_the_oracle(chunk, spec):
    assert_same(observed([SeqLayout("a", 23, 0, list(range(6)))], {"a": spec}))


def test_masked_groups_match_the_oracle(chunk):
    # cached slots (a later prompt chunk), a batch of unequal lengths, one row not observed
    seqs = [SeqLayout("a", 9, 14, list(range(6))), SeqLayout("b", 9, 3, list(range(6, 9))),
            SeqLayout("c", 9, 0, list(range(9, 12)))]
    assert_same(observed(seqs, {"a": BOTH, "b": ObserveSpec(window=12, slot_mass=True)}))
    assert_same(observed(seqs[:1], {"a": BOTH}, window=6, seed=1))  # sliding window: slots below it hidden


def test_decode_rows_bf16_and_other_head_groupings_match_the_oracle(chunk):
    decode = [SeqLayout("a", 1, 10, list(range(3))), SeqLayout("b", 1, 10, list(range(3, 6)))]
    assert_same(observed(decode, {"a": BOTH, "b": BOTH}))  # uniform decode: no mask at all
    assert_same(observed(decode[:1] + [SeqLayout("b", 1, 4, [3, 4])], {"b": BOTH}))
    prefill = [SeqLayout("a", 17, 0, list(range(5)))]
    assert_same(observed(prefill, {"a": BOTH}, heads=4, kv_heads=4))  # no grouping
    assert_same(observed(prefill, {"a": BOTH}, heads=8, kv_heads=1, dtype=torch.bfloat16))


@pytest.mark.parametrize("fault", ["no-mask", "one-slot-ahead", "kv-head-dropped", "query-head-zeroed"])
def test_the_comparison_catches_a_wrong_mask_or_a_missing_head(monkeypatch, fault):
    """The oracle comparison can fail: `attention_stats` broken on purpose disagrees with it."""
    right = ac.attention_stats

    def broken(q, k, scale, mask, causal, spec):
        rep = q.shape[0] // k.shape[0]
        if fault == "no-mask":
            return right(q, k, scale, None, False, spec)
        if fault == "one-slot-ahead":  # every query also sees the slot after its own
            return right(q, k, scale, mask | mask.roll(1, -1), causal, spec)
        if fault == "kv-head-dropped":
            return right(q[:-rep], k[:-1], scale, mask, causal, spec)
        q = q.clone()
        q[-1] = 0  # one query head's scores lost: uniform attention
        return right(q, k, scale, mask, causal, spec)

    monkeypatch.setattr(ac, "attention_stats", broken)
    seqs = [SeqLayout("a", 9, 14, list(range(6)))] if fault == "one-slot-ahead" else \
        [SeqLayout("a", 23, 0, list(range(6)))]
    for _, name, got, want in observed(seqs, {"a": BOTH}):
        assert not torch.allclose(got, want, rtol=1e-5, atol=1e-6), name
