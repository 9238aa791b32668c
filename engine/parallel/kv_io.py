"""A request's KV in and out of a replica of any layout, addressed by (layer, global KV-head range,
token range): the engine side of KV resharding between prefill and decode layouts.

Who calls: `kv_transfer.sender.KVSender` (a parallel prefill, once HELD), `kv_transfer.receiver.KVReceiver`
(a parallel decode, per chunk), tests by hand -> `export_heads(llm, layers, pages, start, stop)` returns
`HeadChunk`s, each the stored bytes of some global KV heads of one layer -> ship them ->
`import_heads(llm, chunk, pages, start, stop)` on the receiving replica writes each chunk into every pool
that holds any of its heads: the ranks whose heads overlap (each replica of a replicated head gets its
copy) or the stage that holds the layer.
One process: the engine's own backend. Tensor parallel: one export per distinct head group (the first
replica), in parallel across ranks. Pipeline parallel: each stage exports its layers. Expert parallel with
data-parallel attention: the one expert group whose pools hold the request's pages (each of its TP ranks its
heads), in that pool's page numbers. Bytes are the
pool's stored cells (`KVPageSpec` storage format), never re-encoded; pages are each side's own.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.kv_cache.page_io import export_kv, import_kv


@dataclass(frozen=True)
class HeadChunk:
    layer: int
    heads: range  # global KV heads in k and v
    k: bytes  # stored cells [num_tokens, len(heads), cell]
    v: bytes


def _holders(llm, pages: list[int]) -> list[tuple[int | None, range, range, list[int]]]:
    """(rank or None for the engine's own pool, global KV heads, global layers, the page table as that pool
    numbers it) of every pool holding some of a request's KV."""
    every = (range(llm.kv_spec.num_kv_heads), range(llm.kv_spec.num_layers))
    if llm.backend is not None:  # one process: its own pool holds everything
        return [(None, *every, pages)]
    pools_of = getattr(llm.runner, "pools_of", None)
    if pools_of is not None:  # expert groups with data-parallel attention: one group holds it, in its numbers
        return pools_of(pages)
    return [(rank, heads, layers, pages) for rank, heads, layers in llm.runner.holders()]


def export_heads(llm, layers: list[int], pages: list[int], start: int, stop: int) -> list[HeadChunk]:
    """Stored K/V of slots [start, stop) of a page table, every KV head once, for `layers`."""
    if llm.backend is not None:
        heads = range(llm.kv_spec.num_kv_heads)
        return [HeadChunk(layer, heads, *(bytes(b) for b in export_kv(llm.backend, layer, pages, start, stop)))
                for layer in layers]
    calls, seen = {}, set()
    for rank, heads, held, local in _holders(llm, pages):
        mine = [layer for layer in layers if layer in held]
        if mine and (heads.start, heads.stop, held.start) not in seen:  # skip replicas of a head group
            seen.add((heads.start, heads.stop, held.start))
            calls[rank] = (heads, mine, local)
    replies = llm.runner.ranks.call_some("export_kv", {r: (mine, local, start, stop) for r, (_, mine, local) in calls.items()})
    return [HeadChunk(layer, calls[r][0], k, v) for r, per_layer in replies.items()
            for layer, (k, v) in zip(calls[r][1], per_layer)]


def _heads_slice(data: bytes, n: int, heads: range, lo: int, hi: int, cell: int) -> bytes:
    """Bytes of global heads [lo, hi) out of cells [n, len(heads), cell] holding `heads`."""
    cells = np.frombuffer(data, dtype=np.uint8).reshape(n, len(heads), cell)
    return cells[:, lo - heads.start:hi - heads.start].tobytes()


def import_heads(llm, chunk: HeadChunk, pages: list[int], start: int, stop: int) -> None:
    """Write a chunk into slots [start, stop) of this replica's page table, in every pool holding any of
    its heads for its layer (local head offsets computed here)."""
    n, cell = stop - start, llm.kv_spec.token_head_bytes()
    calls = {}
    for rank, heads, held, local in _holders(llm, pages):
        lo, hi = max(heads.start, chunk.heads.start), min(heads.stop, chunk.heads.stop)
        if chunk.layer not in held or lo >= hi:
            continue
        payload = (_heads_slice(chunk.k, n, chunk.heads, lo, hi, cell)
                   + _heads_slice(chunk.v, n, chunk.heads, lo, hi, cell))
        args = (chunk.layer, local, start, stop, payload, lo - heads.start, hi - heads.start)
        if rank is None:
            import_kv(llm.backend, *args)
        else:
            calls[rank] = args
    if calls:
        llm.runner.ranks.call_some("import_kv", calls)
