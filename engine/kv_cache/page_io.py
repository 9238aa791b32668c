"""KV bytes in and out of a page pool by flat slot, in the pool's storage format (for the transfer layer).

The KV-transfer layer (`kv_transfer.sender` / `kv_transfer.receiver`) moves pages between processes
without knowing tensors: it asks this module for the stored bytes of some slots of one layer, ships them,
and hands the bytes back on the other side. Bytes are exactly what the backend stores (the `KVPageSpec`'s
storage format), never re-encoded, so quantized formats flow through unchanged once they register here.

    runs = slot_runs(pages, page_size, start, stop)     # token range -> runs of consecutive flat slots
    k, v = export_kv(backend, layer, runs)               # bytes-like, each [n, kv_heads, head_dim]
    import_kv(backend, layer, runs, payload, h0, h1)     # payload = K bytes then V bytes

Storage per layer is `[num_pages, page_size, kv_heads, head_dim]` (the raw backend's layout), so runs of
consecutive slots -- whole pages, or a whole cache when its pages are consecutive -- move as slices.
Only the engine thread may call these on a live engine (they touch cache tensors), except that
`export_kv(copy=False)` may read pages nobody can write meanwhile (a HELD request's).
"""
from __future__ import annotations

import warnings
from typing import Sequence

import torch

from engine.kv_cache.backend import torch_dtype
from engine.kv_cache.spec import KVPageSpec

# Storage formats whose bytes this module can move, with bytes per (token, head) of K (or of V).
_TOKEN_HEAD_BYTES = {"raw": lambda spec: spec.head_dim * spec.itemsize}


def stored_token_head_bytes(spec: KVPageSpec) -> int:
    """Bytes one token of one KV head takes in storage, for K (V is the same size)."""
    try:
        return _TOKEN_HEAD_BYTES[spec.storage_format](spec)
    except KeyError:
        raise ValueError(f"storage format {spec.storage_format!r} has no byte layout for transfer") from None


Runs = list[tuple[int, int, int]]  # (first flat slot, offset into the token range, length)


def slot_runs(pages: Sequence[int], page_size: int, start: int, stop: int) -> Runs:
    """Maximal runs of consecutive flat slots holding slots [start, stop) of a page list (pure Python:
    a page at a time, consecutive page ids merge)."""
    runs: Runs = []
    t = start
    while t < stop:
        page, off = divmod(t, page_size)
        n = min(page_size - off, stop - t)
        slot = pages[page] * page_size + off
        if runs and runs[-1][0] + runs[-1][2] == slot:
            first, at, length = runs[-1]
            runs[-1] = (first, at, length + n)
        else:
            runs.append((slot, t - start, n))
        t += n
    return runs


def export_kv(backend, layer: int, runs: Runs, copy: bool = True) -> tuple[memoryview, memoryview]:
    """Stored K and V of the slot runs as flat byte views, each [n, kv_heads, head_dim].

    copy=True snapshots them (the pool may change afterwards); copy=False returns views of the pool itself
    when the runs are one -- only for pages nobody can write while the views are in use."""
    spec: KVPageSpec = backend.spec
    assert spec.storage_format == "raw", spec.storage_format
    out = []
    for pool in (backend.k[layer], backend.v[layer]):
        flat = pool.view(-1, spec.num_kv_heads, spec.head_dim)  # [num_slots, kv_heads, head_dim]
        if len(runs) == 1:
            first, _, n = runs[0]
            out.append(_bytes_view(flat[first:first + n].clone() if copy else flat[first:first + n]))
        else:
            out.append(_bytes_view(torch.cat([flat[first:first + n] for first, _, n in runs])))
    return out[0], out[1]


def import_kv(backend, layer: int, runs: Runs, payload, head_start: int = 0, head_end: int | None = None) -> None:
    """Write K-then-V `payload` (bytes-like, [n, head_end - head_start, head_dim] each, n = the runs'
    total length) into those heads of the runs' slots, a slice copy per run (several times faster than
    scattering rows)."""
    spec: KVPageSpec = backend.spec
    assert spec.storage_format == "raw", spec.storage_format
    head_end = spec.num_kv_heads if head_end is None else head_end
    n = sum(length for _, _, length in runs)
    with warnings.catch_warnings():  # a read-only payload; we only ever read it
        warnings.simplefilter("ignore", UserWarning)
        kv = torch.frombuffer(payload, dtype=torch_dtype(spec.dtype))
    kv = kv.view(2, n, head_end - head_start, spec.head_dim)  # [K|V, tokens, heads, head_dim]
    for pool, src in ((backend.k[layer], kv[0]), (backend.v[layer], kv[1])):
        flat = pool.view(-1, spec.num_kv_heads, spec.head_dim)
        for first, at, length in runs:
            flat[first:first + length, head_start:head_end].copy_(src[at:at + length])


def _bytes_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy())
