"""Quest's page choice at static shapes (engine/kernels/cuda/quest.py), on CPU under Triton's interpreter: the
bounds kernel against its torch reference, and the whole choice against the eager one (kv_cache/sparse.select)
on the same summaries: the same pages and slots for every row and KV head, ragged rows and a padding row."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine.kernels import reference  # noqa: E402
from engine.kernels.cuda.quest import choose_static, fits, quest_bounds, static_pages  # noqa: E402
from engine.kv_cache import sparse  # noqa: E402
from engine.kv_cache.sparse_config import SparseAttentionConfig  # noqa: E402

PS = 8


def _summaries(seed, pages=80, kv_heads=2, dim=16, q_heads=4, rows=4, lens=(70, 200, 9, 0), width=30):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(pages, kv_heads, dim, generator=g), torch.randn(pages, kv_heads, dim, generator=g)
    lo, hi = torch.minimum(a, b), torch.maximum(a, b)
    table = torch.stack([torch.randperm(pages, generator=g)[:width] for _ in range(rows)])
    q = torch.randn(rows, q_heads, dim, generator=g)
    return q, lo, hi, table, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("gqa_sum", [False, True])
def test_bounds_kernel_matches_reference(gqa_sum):
    q, lo, hi, table, lens = _summaries(0)
    col = table.t().contiguous().t()  # column-major, as the graph's table
    got = quest_bounds(q, lo, hi, col, lens, PS, gqa_sum)
    want = reference.quest_bounds(q, lo, hi, table, lens, PS, gqa_sum)
    assert got.shape == want.shape == (4, 2, 30)
    assert torch.equal(torch.isinf(got), torch.isinf(want))  # -inf past each row's pages, nowhere else
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], atol=1e-5, rtol=1e-5)


def _as_sets(pages, slots):
    """Per (row, KV head): the chosen (page, slots read) pairs with slots > 0."""
    return [[sorted((int(p), int(s)) for p, s in zip(pages[b, h], slots[b, h]) if s > 0)
             for h in range(pages.shape[1])] for b in range(pages.shape[0])]


@pytest.mark.parametrize("select_per,gqa", [("kv_head", "max"), ("kv_head", "sum"), ("row", "max")])
def test_static_choice_equals_the_eager_choice(select_per, gqa):
    cfg = SparseAttentionConfig(budget=4 * PS, sink_pages=1, recent=12, select_per=select_per, gqa=gqa)
    q, lo, hi, table, lens = _summaries(1)
    pages, got_lens = choose_static(cfg, lo, hi, q, table, lens, PS, {}, 0)
    assert pages.shape == (4, 2, static_pages(cfg, PS))
    eager = sparse.select(cfg, lo, hi, q, table, lens.tolist(), PS, {}, kernel=False)
    want = _as_sets(eager.pages, eager.slots)
    npg = [-(-n // PS) for n in lens.tolist()]
    got = _as_sets(pages, _slots(pages, got_lens, table, lens, PS))
    for b in range(4):
        for h in range(2):
            chosen = got[b][h]
            assert sum(s for _, s in chosen) == got_lens[b, h] and len(chosen) == min(npg[b], pages.shape[-1])
            assert chosen == want[b][h], (b, h)
    assert got_lens[3].tolist() == [0, 0]  # the padding row reads nothing


def _slots(pages, lens, table, ctx, ps):
    """Slots of each chosen page, from the row's table: full pages, the row's last page partly filled
    (what the kernel reads given the page list and its length)."""
    out = torch.zeros_like(pages)
    for b in range(pages.shape[0]):
        n = int(ctx[b])
        last = int(table[b, -(-n // ps) - 1]) if n else -1
        for h in range(pages.shape[1]):
            left = int(lens[b, h])
            for i in range(pages.shape[2]):
                take = min(left, n - (-(-n // ps) - 1) * ps if int(pages[b, h, i]) == last else ps)
                out[b, h, i], left = take, left - take
    return out


def test_layers_reuse_the_choice_and_dense_layers_read_all():
    cfg = SparseAttentionConfig(budget=2 * PS, recent=8, selection_layers=(1,), dense_layers=1)
    q, lo, hi, table, lens = _summaries(2)
    plan = {}
    assert choose_static(cfg, lo, hi, q, table, lens, PS, plan, 0) is None  # dense
    first = choose_static(cfg, lo, hi, q, table, lens, PS, plan, 1)
    again = choose_static(cfg, lo * 0 + 5, hi * 0 + 5, q, table, lens, PS, plan, 2)  # reuses layer 1's
    assert again is first


def test_rows_below_min_context_must_fit():
    cfg = SparseAttentionConfig(budget=2 * PS, recent=8, min_context=1000)
    s = static_pages(cfg, PS)
    assert fits(cfg, [s * PS], PS, 100) and not fits(cfg, [s * PS + 1], PS, 100)
    assert fits(cfg, [2000], PS, 1000)  # above min_context: chooses
