"""`engine.kv_cache.page_io` on device pools, run on CPU: the torch path CUDA pools take (staging buffer,
non-blocking copies, device-side scatter; `_on_host` forced False) moves exactly the bytes the numpy path
moves -- consecutive, scattered and reversed pages, any token range, KV-head sub-ranges, raw and int8 cells
-- touches nothing outside its cells, and the sender hands `export_kv_async`'s `ready` to the push thread."""
from __future__ import annotations

import random

import pytest
import torch

from engine.kv_cache import page_io
from engine.kv_cache.backend import RawKVBackend, make_backend
from engine.kv_cache.spec import KVPageSpec
from tests.kv_helpers import page_order

HEADS, DIM = 3, 8


def _backend(page_size, num_pages, dtype="bfloat16", fmt="raw", seed=None):
    b = (RawKVBackend(KVPageSpec(1, HEADS, DIM, page_size, dtype), num_pages) if fmt == "raw" else
         make_backend(KVPageSpec(1, HEADS, DIM, page_size, dtype, fmt), num_pages, "cpu"))
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for pool in (b.k[0], b.v[0]):  # random bytes, whatever the cell's element type
            raw = pool.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))
    return b


@pytest.fixture
def device_path(monkeypatch):
    """Every pool counts as a device pool: page_io takes its torch path (on CPU: no pinning, no events)."""
    monkeypatch.setattr(page_io, "_on_host", lambda backend, layer: False)


CASES = [(kind, ps, span) for kind in ("consecutive", "reversed", "shuffled") for ps in (1, 4, 16)
         for span in ((0, 128), (3, 61), (17, 18), (64, 128))]


@pytest.mark.parametrize("fmt", ["raw", "int8"])
@pytest.mark.parametrize("kind, ps, span", CASES)
def test_export_matches_the_host_path(monkeypatch, fmt, kind, ps, span):
    src = _backend(ps, 128 // ps + 4, fmt=fmt, seed=ps)
    pages = page_order(kind, 128 // ps, 2, random.Random(ps))
    want = page_io.export_kv(src, 0, pages, *span)  # numpy path
    monkeypatch.setattr(page_io, "_on_host", lambda backend, layer: False)
    for k, v in (page_io.export_kv(src, 0, pages, *span), page_io.export_kv_async(src, 0, pages, *span)[:2]):
        assert bytes(k) == bytes(want[0]) and bytes(v) == bytes(want[1])
    k, v, ready = page_io.export_kv_async(src, 0, pages, *span)
    ready()  # (a no-op on CPU; an event's wait on CUDA)
    src.k[0].zero_()
    assert bytes(k) == bytes(want[0]), "the export is a snapshot, not a view of the pool"


@pytest.mark.parametrize("fmt", ["raw", "int8"])
@pytest.mark.parametrize("heads", [(0, 3), (1, 2)])
@pytest.mark.parametrize("kind, ps, span", CASES[::2])
def test_import_matches_the_host_path_and_touches_nothing_else(device_path, fmt, heads, kind, ps, span):
    h0, h1 = heads
    n = span[1] - span[0]
    cell = page_io.stored_token_head_bytes(KVPageSpec(1, HEADS, DIM, ps, "bfloat16", fmt))
    payload = torch.randint(0, 256, (2 * n * (h1 - h0) * cell,), generator=torch.Generator().manual_seed(n),
                            dtype=torch.uint8).numpy().tobytes()
    pages = page_order(kind, 128 // ps, 1, random.Random(n))
    got, want = _backend(ps, 128 // ps + 3, fmt=fmt), _backend(ps, 128 // ps + 3, fmt=fmt)
    page_io.import_kv(got, 0, pages, *span, memoryview(payload), h0, h1)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(page_io, "_on_host", lambda backend, layer: True)
        page_io.import_kv(want, 0, pages, *span, memoryview(payload), h0, h1)
    for a, b in ((got.k[0], want.k[0]), (got.v[0], want.v[0])):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # same cells, and nothing else, written


def test_sender_waits_on_ready_in_the_push_thread_not_the_engine_thread():
    from kv_transfer import codec
    from kv_transfer.contract import TransferDescriptor
    from kv_transfer.sender import Outbound

    spec = KVPageSpec(1, HEADS, DIM, 4, "bfloat16")
    layout = codec.TransferLayout.from_spec(spec, page_io.stored_token_head_bytes(spec))
    ob = Outbound("r", TransferDescriptor("r", "res", "n", "fp", spec.signature(), 8, 0), "addr", layout,
                  list(range(8)), HEADS, 1 << 20, 0.0)
    calls = []
    row = b"\x01" * (HEADS * DIM * 2)
    ob.publish(0, 0, 8, memoryview(row * 8), memoryview(row * 8), ready=lambda: calls.append("ready"))
    assert calls == []  # publishing (the engine thread) never waits
    ob.finish(7)
    frames = list(ob.frames())
    assert calls == ["ready"] and len(frames) == 3  # open, one chunk, finish
