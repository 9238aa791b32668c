"""`engine.kv_cache.page_io`: slot runs match the naive page-table mapping; stored bytes round-trip between
pools of different page sizes, over fragmented pages and KV-head sub-ranges, bit-exactly."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv_cache.backend import RawKVBackend
from engine.kv_cache.page_io import export_kv, import_kv, slot_runs, stored_token_head_bytes
from engine.kv_cache.spec import KVPageSpec


def naive(pages, page_size, start, stop):
    return [pages[t // page_size] * page_size + t % page_size for t in range(start, stop)]


def expand(runs):
    return [first + i for first, _, n in runs for i in range(n)]


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_slot_runs_match_the_page_table(data):
    page_size = data.draw(st.sampled_from([1, 4, 16]))
    pages = data.draw(st.permutations(list(range(12))))[:data.draw(st.integers(1, 12))]
    start = data.draw(st.integers(0, len(pages) * page_size - 1))
    stop = data.draw(st.integers(start + 1, len(pages) * page_size))
    runs = slot_runs(pages, page_size, start, stop)
    assert expand(runs) == naive(pages, page_size, start, stop)
    assert [at for _, at, _ in runs] == [sum(n for _, _, n in runs[:i]) for i in range(len(runs))]
    assert all(a[0] + a[2] != b[0] for a, b in zip(runs, runs[1:]))  # maximal


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bytes_round_trip_across_page_sizes_and_head_ranges(dtype):
    torch.manual_seed(0)
    src = RawKVBackend(KVPageSpec(2, 3, 8, 4, dtype), 10)
    dst = RawKVBackend(KVPageSpec(2, 3, 8, 8, dtype), 6)
    for layer in range(2):
        src.k[layer].normal_()
        src.v[layer].normal_()
    src_pages, dst_pages, n = [7, 2, 3, 9, 0], [4, 1, 5], 19
    assert stored_token_head_bytes(src.spec) == 8 * src.spec.itemsize
    for layer in range(2):
        k, v = export_kv(src, layer, slot_runs(src_pages, 4, 0, n))
        import_kv(dst, layer, slot_runs(dst_pages, 8, 0, n), b"".join((k, v)))
        got = dst.read(layer, torch.tensor(naive(dst_pages, 8, 0, n)))
        want = src.read(layer, torch.tensor(naive(src_pages, 4, 0, n)))
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    # one head, one token range, into a fresh pool: only those cells change
    fresh = RawKVBackend(KVPageSpec(2, 3, 8, 8, dtype), 6)
    k, v = src.read(1, torch.tensor(naive(src_pages, 4, 5, 9)))
    payload = b"".join(bytes(t[:, 1:2].contiguous().view(torch.uint8).numpy()) for t in (k, v))
    import_kv(fresh, 1, slot_runs(dst_pages, 8, 5, 9), payload, head_start=1, head_end=2)
    got_k, _ = fresh.read(1, torch.tensor(naive(dst_pages, 8, 0, n)))
    assert torch.equal(got_k[5:9, 1], k[:, 1]) and torch.count_nonzero(got_k[5:9, [0, 2]]) == 0
    assert torch.count_nonzero(got_k[:5]) == 0 and torch.count_nonzero(got_k[9:]) == 0


def test_export_without_copy_is_a_view_of_one_run_and_a_copy_otherwise():
    b = RawKVBackend(KVPageSpec(1, 2, 4, 4, "float32"), 8)
    k, _ = export_kv(b, 0, slot_runs([2, 3], 4, 0, 8), copy=False)
    b.k[0][2, 0, 0, 0] = 5.0
    assert torch.frombuffer(bytearray(k), dtype=torch.float32)[0] == 5.0  # a view: sees the write
    k2, _ = export_kv(b, 0, slot_runs([3, 2], 4, 0, 8), copy=False)  # two runs: a copy
    b.k[0][3, 0, 0, 0] = 7.0
    assert torch.frombuffer(bytearray(k2), dtype=torch.float32)[0] == 0.0
