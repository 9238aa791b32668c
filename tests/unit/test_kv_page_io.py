"""`engine.kv_cache.page_io`: slot runs match the naive page-table mapping; stored bytes round-trip between
pools of different page sizes -- consecutive, scattered and reversed pages, any token range, KV-head
sub-ranges -- bit-exactly, and writes touch nothing outside their cells."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv_cache.backend import RawKVBackend
from engine.kv_cache.page_io import export_kv, import_kv, slot_runs, stored_token_head_bytes
from engine.kv_cache.spec import KVPageSpec
from tests.kv_helpers import page_order

HEADS, DIM = 3, 8


def naive(pages, page_size, start, stop):
    return [pages[t // page_size] * page_size + t % page_size for t in range(start, stop)]


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_slot_runs_match_the_page_table(data):
    page_size = data.draw(st.sampled_from([1, 4, 16]))
    pages = data.draw(st.permutations(list(range(12))))[:data.draw(st.integers(1, 12))]
    start = data.draw(st.integers(0, len(pages) * page_size - 1))
    stop = data.draw(st.integers(start + 1, len(pages) * page_size))
    runs = slot_runs(pages, page_size, start, stop)
    assert [f + i for f, _, n in runs for i in range(n)] == naive(pages, page_size, start, stop)
    assert [at for _, at, _ in runs] == [sum(n for _, _, n in runs[:i]) for i in range(len(runs))]
    assert all(a[0] + a[2] != b[0] for a, b in zip(runs, runs[1:]))  # maximal


def _pool(page_size, num_pages, dtype, fill=False):
    b = RawKVBackend(KVPageSpec(1, HEADS, DIM, page_size, dtype), num_pages)
    if fill:
        torch.manual_seed(page_size)
        b.k[0].normal_()
        b.v[0].normal_()
    return b


page_lists = st.sampled_from(["consecutive", "reversed", "shuffled"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@settings(max_examples=60, deadline=None)
@given(src_kind=page_lists, dst_kind=page_lists, src_ps=st.sampled_from([1, 4, 16]),
       dst_ps=st.sampled_from([2, 8, 32]), span=st.tuples(st.integers(0, 60), st.integers(1, 64)),
       heads=st.sampled_from([(0, 3), (1, 2), (0, 2)]), rng=st.randoms(use_true_random=False))
def test_bytes_round_trip_across_layouts(dtype, src_kind, dst_kind, src_ps, dst_ps, span, heads, rng):
    n_tok = 128
    start, stop = span[0], min(span[0] + span[1], n_tok)
    src, dst = _pool(src_ps, n_tok // src_ps + 4, dtype, fill=True), _pool(dst_ps, n_tok // dst_ps + 4, dtype)
    src_pages = page_order(src_kind, n_tok // src_ps, 2, rng)
    dst_pages = page_order(dst_kind, n_tok // dst_ps, 1, rng)
    assert stored_token_head_bytes(src.spec) == DIM * src.spec.itemsize
    for copy in (True, False):
        k, v = export_kv(src, 0, src_pages, start, stop, copy=copy)
        want_k, want_v = src.read(0, torch.tensor(naive(src_pages, src_ps, start, stop)))
        got = torch.frombuffer(bytearray(k), dtype=want_k.dtype).view(want_k.shape)
        assert torch.equal(got, want_k)
    h0, h1 = heads
    payload = b"".join(bytes(t[:, h0:h1].contiguous().view(torch.uint8).numpy()) for t in (want_k, want_v))
    import_kv(dst, 0, dst_pages, start, stop, payload, h0, h1)
    all_k, all_v = dst.read(0, torch.tensor(naive(dst_pages, dst_ps, 0, n_tok)))
    for got, want in ((all_k, want_k), (all_v, want_v)):
        assert torch.equal(got[start:stop, h0:h1], want[:, h0:h1])
        outside = got.clone()
        outside[start:stop, h0:h1] = 0
        assert torch.count_nonzero(outside) == 0  # nothing else was touched
    assert torch.count_nonzero(dst.k[0][[p for p in range(dst.num_pages) if p not in dst_pages]]) == 0


def test_export_without_copy_is_a_view_of_consecutive_pages_and_a_copy_otherwise():
    b = _pool(4, 8, "float32")
    k, _ = export_kv(b, 0, [2, 3], 0, 8, copy=False)
    b.k[0][2, 0, 0, 0] = 5.0
    assert torch.frombuffer(bytearray(k), dtype=torch.float32)[0] == 5.0  # a view: sees the write
    k2, _ = export_kv(b, 0, [3, 2], 0, 8, copy=False)  # scattered: gathered, a copy
    b.k[0][3, 0, 0, 0] = 7.0
    assert torch.frombuffer(bytearray(k2), dtype=torch.float32)[0] == 0.0
