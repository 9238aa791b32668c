"""Sparse decode attention (engine/kv_cache/sparse.py): the pages chosen always include the sinks and the
recent window and fit the budget; attention over them equals full attention with every other page masked
out (torch path, and the bf16 paged kernel reading the chosen pages in place, per row or per KV head); a budget >= the context is
full attention exactly in the engine; a small budget runs without leaking pages; bad configs raise typed
errors naming the key."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import SamplingParams
from engine.attention_context import SeqLayout, build_context
from engine.errors import InvalidRequestError
from engine.kernels.cpu.decode_attention import attend_decode_bf16 as _kernel
from engine.kv_cache.backend import make_backend
from engine.kv_cache.sparse import SparseAttentionConfig, select
from engine.kv_cache.spec import KVPageSpec
from engine.llm import LLM
from tests.conftest import assert_engine_empty

PS, KVH, QH, DIM = 4, 2, 4, 16
CTX = [37, 9, 64]  # rows of one decode group: long, below the threshold, long


def _pool(dtype="float32", fmt="raw", cfg=None):
    spec = KVPageSpec(1, KVH, DIM, PS, dtype, fmt)
    be = make_backend(spec, 64)
    be.enable_sparse(cfg or SparseAttentionConfig(budget=8, sink_pages=1, recent=6, min_context=12))
    gen = torch.Generator().manual_seed(1)
    tables, nxt = [], 0
    for n in CTX:
        pages = list(range(nxt, nxt + -(-n // PS)))
        pages = pages[::-1] if n > 40 else pages  # scattered and consecutive tables
        nxt += 20
        slots = torch.tensor([pages[t // PS] * PS + t % PS for t in range(n)])
        k, v = (torch.randn(n, KVH, DIM, generator=gen) for _ in range(2))
        k[:, :, :3] *= 4  # outlier channels, as real keys have
        be.write(0, slots, k.to(be.k[0].dtype) if fmt == "raw" else k, v)
        tables.append(pages)
    seqs = [SeqLayout(f"r{i}", 1, n - 1, p) for i, (n, p) in enumerate(zip(CTX, tables))]
    g = build_context(seqs, PS, DIM ** -0.5, bucket_decode=False).groups[0]
    q = torch.randn(len(CTX), QH, DIM, generator=gen).to(be.k[0].dtype if fmt == "raw" else torch.float32)
    return be, g, q


def _reference(be, g, q, sel):
    """Full attention per row with every slot outside the chosen pages (per KV head) masked out."""
    out = torch.empty(q.shape, dtype=torch.float32)
    for b, n in enumerate(g.ctx_lens):
        pages = g.page_index[b, :-(-n // PS)]
        slots = (pages.view(-1, 1) * PS + torch.arange(PS)).view(-1)[:n]
        k, v = be.read(0, slots)  # [n, kv_heads, D]
        for h in range(QH):
            kvh = h // (QH // KVH)
            chosen = set(sel.pages[b, kvh][sel.slots[b, kvh] > 0].tolist())
            keep = torch.tensor([int(p) in chosen for p in pages for _ in range(PS)][:n])
            s = (k[:, kvh].float() @ q[b, h].float()) * DIM ** -0.5
            out[b, h] = F.softmax(s.masked_fill(~keep, float("-inf")), 0) @ v[:, kvh].float()
    return out


@pytest.mark.parametrize("select_per", ["kv_head", "row"])
def test_selection_keeps_sinks_recent_and_budget(select_per):
    cfg = SparseAttentionConfig(budget=8, sink_pages=1, recent=6, min_context=12, select_per=select_per)
    be, g, q = _pool(cfg=cfg)
    sel = select(cfg, be.summaries.lo[0], be.summaries.hi[0], q, g.page_index, g.ctx_lens, PS)
    for b, n in enumerate(g.ctx_lens):
        n_pages = -(-n // PS)
        for h in range(KVH):
            chosen = sel.pages[b, h][sel.slots[b, h] > 0].tolist()
            table = g.page_index[b, :n_pages].tolist()
            idx = sorted(table.index(p) for p in chosen)
            assert idx == [table.index(p) for p in chosen]  # in page order
            if n < cfg.min_context:
                assert idx == list(range(n_pages))
                continue
            recent = set(range((n - cfg.recent) // PS, n_pages))
            assert {0} | recent <= set(idx)
            assert len(set(idx) - {0} - recent) <= cfg.budget // PS + 1  # + the window's straddled page
            assert sum(sel.slots[b, h].tolist()) < n  # it did leave pages out
            if select_per == "row":
                assert torch.equal(sel.pages[b, h], sel.pages[b, 0])


@pytest.mark.parametrize("fmt", ["raw", "int8"])
def test_sparse_attention_equals_masked_full_attention(fmt):
    be, g, q = _pool(fmt=fmt)
    qq = q @ be.h if fmt == "int8" else q  # the quantized backend scores and attends in its rotated space
    sel = select(be.sparse, be.summaries.lo[0], be.summaries.hi[0], qq, g.page_index, g.ctx_lens, PS)
    out = be._attend_sparse(0, qq, g, DIM ** -0.5)
    if fmt == "int8":
        out = out.float() @ be.h.T
    torch.testing.assert_close(out.float(), _reference(be, g, q, sel), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("select_per", ["kv_head", "row"])
def test_bf16_kernel_reads_the_chosen_pages_in_place(select_per, monkeypatch):
    """Both choices go to the paged kernel (a table per row, or per (row, KV head)), never the gather."""
    import engine.kv_cache.raw as kb  # the raw format module holds the kernel call

    cfg = SparseAttentionConfig(budget=8, sink_pages=1, recent=6, min_context=12, select_per=select_per)
    be, g, q = _pool("bfloat16", cfg=cfg)
    assert be._takes_kernel(g)
    sel = select(cfg, be.summaries.lo[0], be.summaries.hi[0], q, g.page_index, g.ctx_lens, PS)
    assert torch.equal(sel.pages[:, 0], sel.pages[:, 1]) is (select_per == "row")  # the heads chose apart
    tables = []
    monkeypatch.setattr(kb, "attend_decode_bf16", lambda *a: tables.append(a[3].shape) or _kernel(*a))
    monkeypatch.setattr(be, "_page_heads", None)  # the gather path would fail
    out = be._attend_sparse(0, q, g, DIM ** -0.5)  # the paged kernel with shorter page tables
    assert tables == [sel.pages[:, 0].shape if select_per == "row" else sel.pages.shape]
    torch.testing.assert_close(out.float(), _reference(be, g, q, sel), atol=2e-2, rtol=2e-2)


_C = SparseAttentionConfig
ROWS = {"kv_head": [_C(budget=8, recent=6)] * 5, "row/sum": [_C(budget=8, select_per="row", gqa="sum")] * 5,
        "mixed": [_C(budget=8, recent=6), None, _C(budget=16, select_per="row", gqa="sum"),
                  _C(budget=4, sink_pages=0, recent=0), _C(budget=4, min_context=1000)]}


@pytest.mark.parametrize("rows", list(ROWS))
@pytest.mark.parametrize("kvh,qh,dim,native", [(3, 9, 64, "on"), (3, 9, 64, "off"), (2, 4, 16, "off")])
def test_cpu_selection_kernel_chooses_what_the_torch_path_chooses(rows, kvh, qh, dim, native, monkeypatch):
    """bf16 summaries on CPU: quest_select's one call per layer (C where it runs: native "on", else numba)
    against `select(..., kernel=False)`: the same pages and slots per (row, KV head), per-row
    budgets, full rows and padding included."""
    from engine.kernels.cpu import quest_select

    if native == "on" and quest_select.native_library() is None:
        pytest.skip("the C kernels do not run here (no compiler or no AVX512-BF16)")
    monkeypatch.setenv("PDSERVE_NATIVE", "1" if native == "on" else "0")
    g = torch.Generator().manual_seed(kvh + len(rows))
    ctx, ps = [70, 33, 129, 61, 200], 4
    lo = torch.randn(300, kvh, dim, generator=g)
    hi = (lo + torch.rand(300, kvh, dim, generator=g) * 3).to(torch.bfloat16)
    lo = lo.to(torch.bfloat16)
    p = -(-max(ctx) // ps)
    page_index = torch.stack([torch.randperm(299, generator=g)[:p] + 1 for _ in ctx])
    q = torch.randn(len(ctx), qh, dim, generator=g).to(torch.bfloat16)
    cfgs = ROWS[rows]
    got = select(cfgs[0], lo, hi, q, page_index, ctx, ps, rows=cfgs)
    want = select(cfgs[0], lo, hi, q, page_index, ctx, ps, rows=cfgs, kernel=False)
    assert got.lens is not None and want.lens is None  # the kernel's result, then torch's
    assert torch.equal(got.pages, want.pages) and torch.equal(got.slots, want.slots)
    assert (got.lens == want.slots.sum(-1).numpy()).all()
    n_read = want.slots.sum(-1)
    assert (n_read < torch.tensor(ctx).view(-1, 1)).any()  # some rows did leave pages out


def test_budget_covering_the_context_chooses_everything():
    be, g, q = _pool(cfg=SparseAttentionConfig(budget=4096))
    assert select(be.sparse, be.summaries.lo[0], be.summaries.hi[0], q, g.page_index, g.ctx_lens, PS) is None


PROMPTS = [list(range(10, 130)), [7, 8, 9] * 30, list(range(100, 160))]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def _tokens(llm, prompts=PROMPTS):
    out = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert_engine_empty(llm)
    return out


def test_engine_budget_at_least_context_equals_full_attention(tiny_dir):
    full = _tokens(LLM(model=str(tiny_dir), dtype="float32", page_size=4, num_pages=160))
    sparse = _tokens(LLM(model=str(tiny_dir), dtype="float32", page_size=4, num_pages=160,
                         sparse_attention={"budget": 512, "recent": 8}))
    assert sparse == full


def test_engine_small_budget_runs_sparse_and_frees_everything(tiny_dir, monkeypatch):
    from engine.kv_cache import sparse as sp

    chosen = []
    real = sp.select

    def spy(*a, **kw):
        sel = real(*a, **kw)
        chosen.append(sel is not None)
        return sel

    monkeypatch.setattr(sp, "select", spy)
    for fmt, per in (("raw", "kv_head"), ("int8", "row")):
        llm = LLM(model=str(tiny_dir), dtype="float32", page_size=4, num_pages=160, kv_storage=fmt,
                  sparse_attention={"budget": 8, "recent": 8, "sink_pages": 1, "min_context": 32, "select_per": per})
        assert all(len(t) == 16 for t in _tokens(llm))
        assert llm.kv_usage()["summary_bytes"] == 160 * llm.kv_spec.summary_bytes_per_page()
    assert any(chosen)  # decode steps did read a subset of pages


@pytest.mark.parametrize("value, key", [
    ({"budget": 0}, "sparse_attention.budget"), ({"budget": -5}, "sparse_attention.budget"),
    ({"sink_pages": 1.5}, "sparse_attention.sink_pages"), ({"method": "oracle"}, "sparse_attention.method"),
    ({"recent": True}, "sparse_attention.recent"), ({"select_per": "page"}, "sparse_attention.select_per"),
    ({"gqa": "mean"}, "sparse_attention.gqa"), ({"selection_layers": [0, -1]}, "sparse_attention.selection_layers"),
    ({"selection_layers": 3}, "sparse_attention.selection_layers"), ({"bugdet": 3}, "sparse_attention.bugdet"),
    ("on", "sparse_attention"),
])
def test_bad_config_raises_typed_error_naming_the_key(value, key):
    with pytest.raises(InvalidRequestError) as e:
        SparseAttentionConfig.of(value)
    assert e.value.field == key
    assert SparseAttentionConfig.of("off") is None and SparseAttentionConfig.of(None) is None


def test_engine_refuses_kivi4(tiny_dir):
    with pytest.raises(InvalidRequestError) as e:
        LLM(model=str(tiny_dir), dtype="float32", page_size=4, num_pages=64, kv_storage="kivi4",
            sparse_attention={"budget": 64})
    assert e.value.field == "sparse_attention"


@pytest.mark.parametrize("gqa", ["max", "sum"])
def test_page_bounds_bound_every_key_and_pick_the_best(gqa):
    from engine.kv_cache.sparse import _bounds

    cfg = SparseAttentionConfig(budget=8, sink_pages=1, recent=6, min_context=12, gqa=gqa)
    be, g, q = _pool(cfg=cfg)
    bounds = _bounds(cfg, be.summaries.lo[0], be.summaries.hi[0], q, g.page_index)  # [B, P, kv_heads]
    sel = select(cfg, be.summaries.lo[0], be.summaries.hi[0], q, g.page_index, g.ctx_lens, PS)
    for b, n in enumerate(g.ctx_lens):
        table = g.page_index[b, :-(-n // PS)].tolist()
        for i, page in enumerate(table):
            k, _ = be.read(0, torch.tensor([page * PS + t for t in range(min(PS, n - i * PS))]))
            dots = torch.einsum("thd,hgd->thg", k.float(), q[b].float().view(KVH, QH // KVH, DIM))  # [t, kvh, g]
            exact = dots.amax(0).amax(-1) if gqa == "max" else dots.amax(0).sum(-1)  # [kv_heads]
            assert (bounds[b, i] >= exact - 1e-4).all()
        if n < cfg.min_context:
            continue
        free = set(range(1, (n - cfg.recent) // PS))  # neither sink nor recent: chosen by bound
        for h in range(KVH):
            chosen = {table.index(p) for p in sel.pages[b, h][sel.slots[b, h] > 0].tolist()} & free
            if chosen and free - chosen:
                assert min(bounds[b, i, h] for i in chosen) >= max(bounds[b, i, h] for i in free - chosen)


def test_engine_sparse_with_drafts_rolled_back_and_shared_prefixes(tiny_dir):
    """Rejected drafts roll slots back (summaries recomputed through BlockTables.on_truncate) and cached
    prefix pages are shared: every live page's summary stays equal to its recomputation, nothing leaks."""
    llm = LLM(model=str(tiny_dir), dtype="float32", page_size=4, num_pages=200, enable_prefix_caching=True,
              speculative={"proposer": "always_wrong", "max_draft": 3, "gate": False,
                           "proposer_options": {"futures": {tuple(p): list(range(40, 60)) for p in PROMPTS}}},
              sparse_attention={"budget": 8, "recent": 8, "min_context": 32})
    s = llm.backend.summaries
    checked = 0
    for rid, p in enumerate(PROMPTS + PROMPTS[:1]):  # the last one hits the cached pages of the first
        llm.add_request(p, GREEDY, request_id=f"q{rid}")
        if rid < len(PROMPTS) - 1:
            continue
        checked += _steps_checking(llm, s)
    assert checked > 0
    assert llm.spec.stats.num_drafted > llm.spec.stats.num_accepted  # drafts were rolled back
    assert llm.prefix_stats()["hit_tokens"] > 0
    assert_engine_empty(llm)


def _steps_checking(llm, s) -> int:
    checked = 0
    while llm.has_unfinished():
        llm.step()
        for seq in list(llm.tables._tables):
            t = llm.tables.get(seq)
            for i, page in enumerate(t.pages[:-(-t.num_slots // 4)]):
                filled = min(4, t.num_slots - i * 4)
                for layer in llm.kv_spec.local_layers:
                    lo, hi = s.expected(layer, page, filled)
                    assert torch.equal(s.lo[layer][page], lo) and torch.equal(s.hi[layer][page], hi)
                    checked += 1
    return checked


def test_selection_layers_choose_once_and_the_others_reuse(tiny_dir, monkeypatch):
    from engine.kv_cache import sparse as sp

    calls = []
    real = sp.select
    monkeypatch.setattr(sp, "select", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    cfg = {"budget": 8, "recent": 8, "min_context": 32, "selection_layers": [0]}
    llm = LLM(model=str(tiny_dir), dtype="float32", page_size=4, num_pages=160, sparse_attention=cfg)
    assert llm.sparse_attention.selection_layers == (0,)
    seen = []
    orig = llm.backend._attend_sparse

    def spy(layer, q, g, scale):
        out = orig(layer, q, g, scale)
        seen.append((layer, g, g.sparse_plan.get("chosen")))  # (objects kept alive: no id reuse)
        return out

    llm.backend._attend_sparse = spy
    assert all(len(t) == 16 for t in _tokens(llm, PROMPTS[:1]))
    assert any(x[2] is not None for x in seen)  # some steps read a subset
    groups = {id(g): g for _, g, _ in seen}
    assert len(calls) == len(groups)  # one choice per group and step, at layer 0
    for gid in groups:
        chosen = [c for _, g, c in seen if id(g) == gid]
        assert len(chosen) == 2 and chosen[0] is chosen[1]  # layer 1 read layer 0's pages
