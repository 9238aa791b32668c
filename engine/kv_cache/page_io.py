"""KV bytes in and out of a page pool by flat slot, in the pool's storage format (for the transfer layer).

The KV-transfer layer (`kv_transfer.sender` / `kv_transfer.receiver`) moves pages between processes
without knowing tensors: it asks this module for the stored bytes of some slots of one layer, ships them,
and hands the bytes back on the other side. Bytes are exactly what the backend stores (the `KVPageSpec`'s
storage format), never re-encoded, so quantized formats flow through unchanged once they register here.

    slots = flat_slots(pages, page_size, start, stop)       # token range -> flat slot ids of this pool
    k, v = export_kv(backend, layer, slots)                  # bytes-like, each [n, kv_heads, head_dim]
    import_kv(backend, layer, slots, payload, h0, h1)        # payload = K bytes then V bytes

Only the engine thread may call these on a live engine (they touch cache tensors).
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


def flat_slots(pages: Sequence[int], page_size: int, start: int, stop: int) -> torch.Tensor:
    """Flat slot ids (page * page_size + offset) of slots [start, stop) of a page list: [stop - start]."""
    idx = torch.arange(start, stop, dtype=torch.long)
    table = torch.as_tensor(list(pages), dtype=torch.long)
    return table[idx // page_size] * page_size + idx % page_size


def export_kv(backend, layer: int, slots: torch.Tensor) -> tuple[memoryview, memoryview]:
    """Stored K and V of the slots as flat byte views (a copy; the pool may change afterwards)."""
    assert backend.spec.storage_format == "raw", backend.spec.storage_format
    k, v = backend.read(layer, slots)  # [n, kv_heads, head_dim] each, fresh tensors
    return _bytes_view(k), _bytes_view(v)


def import_kv(backend, layer: int, slots: torch.Tensor, payload: bytes, head_start: int = 0,
              head_end: int | None = None) -> None:
    """Write K-then-V `payload` ([n, head_end - head_start, head_dim] each) into the slots' heads."""
    spec: KVPageSpec = backend.spec
    assert spec.storage_format == "raw", spec.storage_format
    head_end = spec.num_kv_heads if head_end is None else head_end
    n, heads = slots.shape[0], head_end - head_start
    with warnings.catch_warnings():  # the payload is read-only bytes; we only ever read it
        warnings.simplefilter("ignore", UserWarning)
        kv = torch.frombuffer(payload, dtype=torch_dtype(spec.dtype))
    kv = kv.view(2, n, heads, spec.head_dim)  # [K|V, tokens, heads, head_dim]
    if heads == spec.num_kv_heads:
        backend.write(layer, slots, kv[0], kv[1])
        return
    k, v = backend.read(layer, slots)  # a head sub-range: read, patch those heads, write back
    k[:, head_start:head_end] = kv[0]
    v[:, head_start:head_end] = kv[1]
    backend.write(layer, slots, k, v)


def _bytes_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy())
