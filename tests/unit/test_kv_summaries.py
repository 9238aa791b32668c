"""Sparse attention's page summaries (engine/kv_cache/summaries.py): after any random sequence of writes,
rollbacks, frees (and reuse of the freed pages), prefix sharing, KV imported over the wire (out of order,
by KV-head range) and eviction compaction, each live page's per-layer key min/max equals the one recomputed
from the page's stored keys over its filled slots -- for raw and int8 pages."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv_cache.allocator import PageAllocator
from engine.kv_cache.backend import make_backend
from engine.kv_cache.block_table import BlockTables
from engine.kv_cache.eviction import compact
from engine.kv_cache.page_io import export_kv, import_kv
from engine.kv_cache.sparse import SparseAttentionConfig, install
from engine.kv_cache.spec import KVPageSpec

PS, HEADS, DIM, LAYERS, PAGES = 4, 2, 8, 2, 24


class Pool:
    def __init__(self, fmt: str):
        spec = KVPageSpec(LAYERS, HEADS, DIM, PS, "float32", fmt)
        self.backend = make_backend(spec, PAGES)
        self.allocator = PageAllocator(PAGES)
        self.tables = BlockTables(self.allocator, PS)
        install(self.backend, self.allocator, self.tables, SparseAttentionConfig())
        self.shared: dict[str, int] = {}  # seq -> slots it must keep (shared prefix pages)
        self.gen = torch.Generator().manual_seed(0)

    def write(self, seq: str, n: int) -> None:
        start = self.tables.get(seq).num_slots if seq in self.tables else 0
        self.tables.append(seq, n)
        slots = torch.tensor(self.tables.slots(seq, start, n))
        for layer in range(LAYERS):
            k, v = (torch.randn(n, HEADS, DIM, generator=self.gen) * 3 for _ in range(2))
            self.backend.write(layer, slots, k, v)

    def check(self) -> None:
        s = self.backend.summaries
        for seq in list(self.tables._tables):
            t = self.tables.get(seq)
            for i, page in enumerate(t.pages):
                filled = min(PS, t.num_slots - i * PS)
                if filled <= 0:
                    continue
                assert s.extent[page] == filled, (seq, i, page)
                for layer in range(LAYERS):
                    lo, hi = s.expected(layer, page, filled)
                    assert torch.equal(s.lo[layer][page], lo) and torch.equal(s.hi[layer][page], hi), (seq, page)


def _import(pool: Pool, src: Pool, seq: str, n: int, order, split_heads: bool) -> None:
    """KV of `n` slots of a fresh sequence on `src`, shipped into a new sequence of `pool` in chunks."""
    src.write("src", n)
    src_pages = src.tables.get("src").pages
    pool.tables.append(seq, n)
    pages = pool.tables.get(seq).pages
    cuts = sorted({0, n, *[c for c in order if 0 < c < n]})
    chunks = list(zip(cuts, cuts[1:]))
    chunks = chunks[::-1] if len(order) % 2 else chunks  # arrival out of order
    for layer in range(LAYERS):
        for a, b in chunks:
            k, v = export_kv(src.backend, layer, src_pages, a, b)
            heads = [(0, 1), (1, HEADS)] if split_heads else [(0, HEADS)]
            kb = torch.frombuffer(bytearray(k), dtype=torch.uint8).view(b - a, HEADS, -1)
            vb = torch.frombuffer(bytearray(v), dtype=torch.uint8).view(b - a, HEADS, -1)
            for h0, h1 in heads:
                payload = torch.cat([kb[:, h0:h1].reshape(-1), vb[:, h0:h1].reshape(-1)]).numpy().tobytes()
                import_kv(pool.backend, layer, pages, a, b, payload, h0, h1)
    src.tables.free("src")


ops = st.lists(st.tuples(st.sampled_from(["write", "write", "rollback", "free", "share", "import", "compact"]),
                         st.integers(0, 3), st.integers(1, 11), st.lists(st.integers(0, 12), max_size=3),
                         st.booleans()), max_size=25)


@pytest.mark.parametrize("fmt", ["raw", "int8"])
@settings(max_examples=60, deadline=None)
@given(ops=ops)
def test_summaries_equal_recomputed_after_any_history(fmt, ops):
    pool, src = Pool(fmt), Pool(fmt)
    for i, (op, who, n, cuts, flag) in enumerate(ops):
        seq = f"s{who}"
        live = seq in pool.tables
        if op == "write" and pool.tables.extra_pages_needed(seq, n) <= pool.allocator.num_free:
            pool.write(seq, n)
        elif op == "rollback" and live:
            t = pool.tables.get(seq)
            pool.tables.truncate(seq, max(pool.shared.get(seq, 0), t.num_slots - n))
        elif op == "free" and live:
            pool.tables.free(seq)
        elif op == "share" and live and not f"x{i}" in pool.tables:
            t = pool.tables.get(seq)
            full = t.pages[:t.num_slots // PS]
            if full:
                pool.tables.share_prefix(f"x{i}", full)
                pool.shared[f"x{i}"] = len(full) * PS  # neither side writes or rolls back shared pages
                pool.shared[seq] = max(pool.shared.get(seq, 0), len(full) * PS)
        elif op == "import" and not live and -(-n // PS) <= min(pool.allocator.num_free, src.allocator.num_free):
            _import(pool, src, seq, n, cuts, flag)
        elif op == "compact" and live and seq not in pool.shared:
            t = pool.tables.get(seq)
            keep = sorted(set(c % t.num_slots for c in cuts)) if t.num_slots else []
            if keep:  # eviction keeps a subset of slots, moved to the front; the table shrinks after
                compact(pool.backend, t.pages, {layer: torch.tensor(keep) for layer in range(LAYERS)})
                pool.tables.truncate(seq, len(keep))
        pool.check()


def test_freed_page_reused_starts_a_fresh_summary():
    pool = Pool("raw")
    pool.write("a", 7)
    page = pool.tables.get("a").pages[0]
    pool.tables.free("a")
    pool.write("b", 2)  # the low page first: the freed one again, only 2 slots filled now
    assert pool.tables.get("b").pages[0] == page
    pool.check()


def test_summary_memory_is_counted():
    spec = KVPageSpec(LAYERS, HEADS, DIM, PS, "bfloat16")
    assert spec.bytes_per_page(summaries=True) - spec.bytes_per_page() == spec.summary_bytes_per_page()
    assert spec.summary_bytes_per_page() == 2 * HEADS * DIM * 2 * LAYERS
    pool = Pool("raw")
    assert pool.backend.summaries.nbytes() == PAGES * KVPageSpec(LAYERS, HEADS, DIM, PS, "float32").summary_bytes_per_page()
