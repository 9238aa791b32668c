"""KV bytes in and out of a page pool by flat slot, in the pool's storage format (for the transfer layer).

The KV-transfer layer (`kv_transfer.sender` / `kv_transfer.receiver`) moves pages between processes
without knowing tensors: it asks this module for the stored bytes of some slots of one layer, ships them,
and hands the bytes back on the other side. Bytes are exactly what the backend stores (the `KVPageSpec`'s
storage format), never re-encoded, so quantized formats flow through unchanged once they register here.

    k, v = export_kv(backend, layer, pages, start, stop)            # bytes-like, [n, kv_heads, cell]
    import_kv(backend, layer, pages, start, stop, payload, h0, h1)  # payload = K bytes then V bytes

Slots [start, stop) of a page list are addressed with the pool's own page size. Storage per layer is
`[num_pages, page_size, kv_heads, cell]`, where a cell is one (token, head): head_dim values in the
compute dtype (raw), or head_dim + 2 bytes (int8/fp8, `quantized.py`), or a kivi4 cell (`kivi.py`: 4-bit
values plus a share of the page's key scales); this module only moves cells, whatever their element type.
kivi4 ships sealed pages only (a partly filled page lives in full-precision staging: KVFormatError), and
marks imported pages sealed. Consecutive slots move as one
slice, scattered pages as one gather/scatter of whole pages (plus the partial edge pages), so the cost
does not depend on how fragmented the free list was. Moves go through numpy views of the (CPU) pools,
cells as integer words (`_pools`): plain memcpy, several times faster than torch's copy kernels.
Only the engine thread may call these on a live engine (they touch cache tensors), except that
`export_kv(copy=False)` may read pages nobody can write meanwhile (a HELD request's).

Device (CUDA) pools cannot be viewed from the host: their bytes cross once each way through pinned host
memory. Export: runs of slots (or one gather of whole pages) are copied device -> a pinned staging buffer
with non-blocking copies, and the views handed out are of that buffer; `export_kv_async` returns a
`ready()` to call before reading them (the sender's layer hook uses it, so the prefill step never waits on
the GPU; the push thread waits), `export_kv` waits itself. Import: the payload goes into a pinned buffer
(the one host copy), then host -> device once, then device-side slice/page copies into the pools; the call
returns when the write has landed (an event), so "no write in flight" means the same on every device.
Streams: exports run on the caller's current stream (the default one), ordered after the kernels that wrote
the pages; imports run on a side stream of their own (`_copy_stream`), so a received chunk does not queue
behind the decode steps the engine has launched meanwhile: its pages are pinned for the transfer (nothing
reads or writes them until the commit, which comes after the write has landed), and `stream_fence`, taken
when they were reserved, orders the write after whatever the engine had queued on them before.
"""
from __future__ import annotations

import contextlib
from typing import Sequence

import numpy as np
import torch

from engine.kv_cache.spec import KVPageSpec

def stored_token_head_bytes(spec: KVPageSpec) -> int:
    """Bytes one token of one KV head takes in storage, for K (V is the same size)."""
    return spec.token_head_bytes()


Runs = list[tuple[int, int, int]]  # (first flat slot, offset into the token range, length)


def slot_runs(pages: Sequence[int], page_size: int, start: int, stop: int) -> Runs:
    """Maximal runs of consecutive flat slots holding slots [start, stop) of a page list (pure Python:
    a page at a time, consecutive page ids merge; one list comparison when they are all consecutive,
    the usual case, which every received chunk pays)."""
    if stop <= start:
        return []
    p0, p1 = start // page_size, -(-stop // page_size)
    first = pages[p0]
    if pages[p1 - 1] - first == p1 - 1 - p0 and pages[p0:p1] == list(range(first, first + p1 - p0)):
        return [(first * page_size + start - p0 * page_size, 0, stop - start)]
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


def export_kv(backend, layer: int, pages: Sequence[int], start: int, stop: int,
              copy: bool = True) -> tuple[memoryview, memoryview]:
    """Stored K and V of slots [start, stop) of a page list, as flat byte views [n, kv_heads, cell].

    copy=True snapshots them (the pool may change afterwards); copy=False returns views of the pool
    itself when the slots are consecutive -- only for pages nobody writes while the views are in use.
    Scattered pages are gathered whole, in one op (a page is a contiguous block of the pool).
    A device pool is always copied (into pinned host memory; this waits for the copy)."""
    if not _on_host(backend, layer):
        k, v, ready = _export_device(backend, layer, pages, start, stop)
        ready()
        return k, v
    spec: KVPageSpec = backend.spec
    ps, runs = spec.page_size, slot_runs(pages, spec.page_size, start, stop)
    p0, p1 = start // ps, -(-stop // ps)
    if hasattr(backend, "sealed"):  # kivi4: only sealed pages hold their tokens in cells
        _check_sealed(backend, pages[p0:p1])
    out = []
    for pool in _pools(backend, layer):  # [num_pages, page_size, kv_heads, words]
        flat = pool.reshape(-1, spec.num_kv_heads, pool.shape[-1])
        if len(runs) == 1:
            t = flat[runs[0][0]:runs[0][0] + runs[0][2]]
            t = t.copy() if copy else t
        else:  # fancy indexing copies
            t = pool[list(pages[p0:p1])].reshape(-1, spec.num_kv_heads, pool.shape[-1])[start - p0 * ps:stop - p0 * ps]
        out.append(memoryview(np.ascontiguousarray(t).reshape(-1).view(np.uint8)))
    return out[0], out[1]


def export_kv_async(backend, layer: int, pages: Sequence[int], start: int, stop: int):
    """`export_kv(copy=True)` without waiting: (k, v, ready). On a device pool the bytes are still on their
    way into pinned host memory: call `ready()` (it blocks until they landed) before reading k or v. On a
    CPU pool they are there already and `ready` is None."""
    if _on_host(backend, layer):
        return (*export_kv(backend, layer, pages, start, stop), None)
    return _export_device(backend, layer, pages, start, stop)


def stream_fence(backend):
    """Device pools: an event marking the work queued so far on the caller's stream (the engine thread's, at
    reservation time), for `import_kv(after=...)`; None for CPU pools."""
    dev = backend.k[backend.spec.local_layers[0]].device
    return _event(dev) if dev.type == "cuda" else None


def import_kv(backend, layer: int, pages: Sequence[int], start: int, stop: int, payload,
              head_start: int = 0, head_end: int | None = None, after=None) -> None:
    """Write K-then-V `payload` (bytes-like, [stop - start, head_end - head_start, cell] each) into
    those heads of slots [start, stop) of a page list: a slice copy per run of consecutive slots, or --
    for scattered pages with every head -- one scatter of whole pages plus the partial edge pages.
    `after`: a `stream_fence` the device write waits for (on the GPU, not here)."""
    spec: KVPageSpec = backend.spec
    head_end = spec.num_kv_heads if head_end is None else head_end
    ps, n, heads = spec.page_size, stop - start, head_end - head_start
    host = _on_host(backend, layer)
    pools = _pools(backend, layer) if host else _device_pools(backend, layer)  # [num_pages, page_size, kv_heads, words]
    cell = pools[0].shape[-1]
    runs = slot_runs(pages, ps, start, stop)
    first_full, end_full = -(-start // ps), stop // ps  # pages wholly inside [start, stop)
    full = None  # (src rows of the whole pages, those pages): one scatter, then the partial edge pages
    if len(runs) > 2 and heads == spec.num_kv_heads and end_full - first_full >= 2:
        full = (first_full * ps - start, end_full * ps - start, list(pages[first_full:end_full]))
    if host:
        kv = np.frombuffer(payload, dtype=pools[0].dtype).reshape(2, n, heads, cell)  # [K|V, tokens, heads, words]
        for pool, src in zip(pools, kv):
            flat = pool.reshape(-1, spec.num_kv_heads, cell)
            todo = runs
            if full is not None:
                lo, hi, whole = full
                pool[whole] = src[lo:hi].reshape(len(whole), ps, heads, cell)
                todo = _clip_edges(runs, lo, hi)
            for first, at, length in todo:
                flat[first:first + length, head_start:head_end] = src[at:at + length]
    else:
        _import_device(pools, spec, runs, full, payload, (n, heads, cell), head_start, head_end, after)
    if getattr(backend, "summaries", None) is not None:  # sparse attention: rebuilt from the imported keys
        backend.summaries.update_range(layer, pages, start, stop)
    if hasattr(backend, "mark_imported"):  # kivi4: the cells are a sealed page's (the sender checked)
        backend.mark_imported(pages[start // ps:-(-stop // ps)])


def _on_host(backend, layer: int) -> bool:
    """The pools of `layer` live in host memory (numpy views); otherwise they are device tensors."""
    return backend.k[layer].device.type == "cpu"


_RUN_COPIES = 4  # up to this many runs of slots are copied one by one; more: one gather of whole pages


def _export_device(backend, layer: int, pages: Sequence[int], start: int, stop: int):
    """Device pools -> one pinned host buffer [K|V, n, kv_heads, words] by non-blocking copies (a run of
    slots is contiguous in the pool: copied straight across; many runs: whole pages gathered on the
    device first). (k, v, ready): byte views of the buffer and the wait for the copies."""
    spec: KVPageSpec = backend.spec
    ps, runs = spec.page_size, slot_runs(pages, spec.page_size, start, stop)
    p0, p1 = start // ps, -(-stop // ps)
    if hasattr(backend, "sealed"):
        _check_sealed(backend, pages[p0:p1])
    pools = _device_pools(backend, layer)  # [num_pages, page_size, kv_heads, words] each
    heads, words, dev = spec.num_kv_heads, pools[0].shape[-1], pools[0].device
    cuda = dev.type == "cuda"
    with torch.inference_mode():
        host = torch.empty((2, stop - start, heads, words), dtype=pools[0].dtype, pin_memory=cuda)
        index = _upload(pages[p0:p1], dev) if len(runs) > _RUN_COPIES else None
        for i, pool in enumerate(pools):
            if index is None:
                flat = pool.view(-1, heads, words)
                for first, at, length in runs:
                    host[i, at:at + length].copy_(flat[first:first + length], non_blocking=True)
            else:
                rows = pool.index_select(0, index).view(-1, heads, words)[start - p0 * ps:stop - p0 * ps]
                host[i].copy_(rows, non_blocking=True)
        ready = _event(dev).synchronize if cuda else (lambda: None)
    raw = host.numpy().reshape(2, -1).view(np.uint8)  # (the views keep the pinned buffer alive)
    return memoryview(raw[0]), memoryview(raw[1]), ready


def _import_device(pools, spec: KVPageSpec, runs: Runs, full, payload, shape: tuple[int, int, int],
                   head_start: int, head_end: int, after=None) -> None:
    """Payload -> pinned host buffer (the one host copy) -> device once -> slices/pages of the pools;
    returns once the writes have landed (the receiver frees pages only when no write is in flight)."""
    n, heads, words = shape
    dev = pools[0].device
    cuda = dev.type == "cuda"
    with torch.inference_mode(), (torch.cuda.stream(_copy_stream(dev)) if cuda else contextlib.nullcontext()):
        if after is not None:
            torch.cuda.current_stream(dev).wait_event(after)  # the pages' earlier users are done with them
        src = np.frombuffer(payload, dtype=np.uint8)
        host = torch.empty(src.size, dtype=torch.uint8, pin_memory=cuda)
        host.numpy()[:] = src
        kv = host.to(dev, non_blocking=True).view(pools[0].dtype).view(2, n, heads, words)  # [K|V, n, heads, words]
        index = _upload(full[2], dev) if full is not None else None
        for pool, part in zip(pools, kv):
            flat = pool.view(-1, spec.num_kv_heads, words)
            todo = runs
            if full is not None:
                lo, hi, whole = full
                pool.index_copy_(0, index, part[lo:hi].reshape(len(whole), spec.page_size, heads, words))
                todo = _clip_edges(runs, lo, hi)
            for first, at, length in todo:
                flat[first:first + length, head_start:head_end].copy_(part[at:at + length])
        if cuda:
            _event(dev).synchronize()


def _upload(pages: Sequence[int], dev: torch.device) -> torch.Tensor:
    """A page list as an index tensor on `dev` (CUDA: through pinned memory, so the copy never waits)."""
    t = torch.tensor(list(pages), dtype=torch.long)
    return t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else t


_COPY_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _copy_stream(dev: torch.device) -> "torch.cuda.Stream":
    """The side stream received KV is written on (one per device, shared by the transport threads)."""
    stream = _COPY_STREAMS.get(dev)
    return stream if stream is not None else _COPY_STREAMS.setdefault(dev, torch.cuda.Stream(dev))


def _event(dev: torch.device):
    """A CUDA event recorded now on the current stream of `dev`."""
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(dev))
    return ev


def _device_pools(backend, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V pools of one layer as torch views of the same words `_pools` uses (no copy)."""
    out = []
    for pool in (backend.k[layer], backend.v[layer]):
        raw = pool.view(torch.uint8)  # [..., cell bytes]
        word = next(w for w in (torch.int64, torch.int32, torch.int16, torch.uint8) if raw.shape[-1] % w.itemsize == 0)
        out.append(raw.view(word))
    return out[0], out[1]


def _pools(backend, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """K and V pools of one layer as numpy views, each cell's bytes as the widest integers that tile it
    (int64 for raw cells of an even head_dim). Only bytes move here, and numpy moves them with memcpy,
    where torch runs an element loop (measured on 2.13 CPU: a 262 KB bfloat16 slice ~50 us in torch, as
    int64 ~12 us, in numpy ~8 us; 21 scattered pages by index_copy_ ~250 us, in numpy ~9 us).
    CPU pools only: this module hands out and takes host bytes. The views are kept on the backend
    (`_io_views`, per layer): making them costs ~25 us a layer, which every received chunk paid."""
    views = backend.__dict__.setdefault("_io_views", {})
    pair = views.get(layer)
    if pair is None or pair[2] is not backend.k[layer] or pair[3] is not backend.v[layer]:
        out = []
        for pool in (backend.k[layer], backend.v[layer]):
            raw = pool.view(torch.uint8).numpy()  # [..., cell bytes]; a view, never a copy
            word = next(w for w in (np.int64, np.int32, np.int16, np.uint8) if raw.shape[-1] % np.dtype(w).itemsize == 0)
            out.append(raw.view(word))
        pair = views[layer] = (out[0], out[1], backend.k[layer], backend.v[layer])
    return pair[0], pair[1]


def _check_sealed(backend, pages: Sequence[int]) -> None:
    unsealed = [p for p in pages if not bool(backend.sealed[p])]
    if unsealed:
        from engine.kv_cache.kivi import KVFormatError

        raise KVFormatError(f"kivi4 pages {unsealed} are not sealed (partly filled: their tokens are in "
                            f"full-precision staging, not in cells); kivi4 exports whole pages only (page_size "
                            f"{backend.spec.page_size}): a transfer ships kivi.shipped_tokens() and the decode "
                            f"side recomputes the tail")


def _clip_edges(runs: Runs, lo: int, hi: int) -> Runs:
    """The parts of `runs` outside token offsets [lo, hi) (the partial first and last pages)."""
    out: Runs = []
    for first, at, length in runs:
        if at < lo:
            out.append((first, at, min(length, lo - at)))
        if at + length > hi:
            cut = max(at, hi)
            out.append((first + cut - at, cut, at + length - cut))
    return out
