"""Dense decode KV: a decode group's K/V kept as one dense copy across steps, so a step appends one slot
per row instead of gathering every page of every row again.

Why: a decode group reads `batch x context` slots per layer; gathering them from scattered pages read and
wrote all of it (plus the read by attention) in every layer of every step: ~20-30% of a batch-16 decode
step at context 300 (bench `step16`). With the copy kept, a continuing step moves `batch` slots per layer.

Owned by `RawKVBackend` (raw pages only: quantized formats decode cells and KIVI seals pages later).
Life cycle, per step (a new `AttentionContext`), at its first `attend`:
  1. `plan(ctx)`: each large decode group (one query per row, >= MIN_GROUP_BYTES of K + V a layer; smaller
     ones gather, hot in cache) is matched with the previous step's group of the
     same request ids in the same order. It *continues* when every row grew by exactly one slot and the
     pages holding its old slots are the same; otherwise it is *filled*: one whole-page gather per layer
     (what the plain path does every step) into a buffer with room to grow. Mirrors of groups absent from
     this step are dropped (their buffers kept as spares for the next fill).
  2. `load(layer, g)`: fill (gather) or append (this step's new slots, already written to the pages), then
     a view [B, ctx, kv_heads, head_dim] of the copy.
Only consecutive steps chain: a request that was truncated, compacted, re-prefilled or re-imported between
two steps either left the group or changed its slot count, so slots below a mirrored row's old length can
only change through pages that the chain check compares.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.attention_context import AttentionContext, AttnGroup

GROW_SLOTS = 32  # room each row gets past its context on a fill: one fill per this many continuing steps
MAX_BYTES = 1 << 30  # K + V over all layers of all live copies; larger groups take the gather path
SPARE_BYTES = 512 << 20  # buffers of dropped copies kept for later fills (newest first)
# K + V of one layer of a group below which the page gather stays: its workspace stays cache-resident and
# attention reads it hot, which measured no slower than reading the copy cold (bench `batch`: buckets of
# ~4 rows); above it the gather streams the context through memory twice (bench `step16`, 16 x 300 slots,
# ~4 MB a layer: the step took ~0.9x the gather path's time with the copy).
MIN_GROUP_BYTES = 3 << 20


@dataclass
class _Mirror:
    request_ids: tuple[str, ...]
    ctx_lens: list[int]  # slots per row after the step that last touched the copy
    pages: list[list[int]]  # pages holding those slots, per row
    cap: int  # slots per row in the copy (a multiple of page_size)
    bufs: dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> K, V [B * cap * kv_heads * cell] flat
    fill_index: torch.Tensor | None = None  # [B * cap / page_size] pages to gather this step (a fill)
    append_dst: torch.Tensor | None = None  # [B] rows of the copy [B * cap] that get this step's slots
    append_src: torch.Tensor | None = None  # [B] flat pool slots written this step

    @property
    def numel(self) -> int:
        return len(self.request_ids) * self.cap


@dataclass
class DenseDecode:
    page_size: int
    cell_shape: tuple[int, int]  # (kv_heads, cell)
    bytes_per_slot: int  # K + V over all local layers
    num_layers: int  # local layers
    mirrors: dict[tuple[str, ...], _Mirror] = field(default_factory=dict)
    spares: list[dict] = field(default_factory=list)  # bufs of dropped mirrors, reused by fills
    _ctx: AttentionContext | None = None
    _by_group: dict[int, _Mirror] = field(default_factory=dict)  # id(group) -> mirror, this step

    def plan(self, ctx: AttentionContext) -> None:
        """Match this step's decode groups with the previous step's copies (see the module map)."""
        if ctx is self._ctx:
            return
        old, self.mirrors, self._by_group, self._ctx = self.mirrors, {}, {}, ctx
        budget = MAX_BYTES
        for g in ctx.groups:
            if g.q_len != 1 or g.batch < 2:  # one row: the contiguous view or a small gather is enough
                continue
            if g.batch * max(g.ctx_lens) * self.bytes_per_slot < MIN_GROUP_BYTES * self.num_layers:
                continue
            key = tuple(g.request_ids)
            m = old.pop(key, None)
            rows = g.page_index.tolist()
            if m is not None and not self._continue(m, g, rows, ctx):
                self.spares.append(m.bufs)
                m = None
            if m is None:
                m = self._fill(g, rows, key)
            if m.numel * self.bytes_per_slot > budget:
                self.spares.append(m.bufs)
                continue
            budget -= m.numel * self.bytes_per_slot
            self.mirrors[key] = self._by_group[id(g)] = m
        self.spares.extend(m.bufs for m in old.values())
        self._trim_spares()

    def _trim_spares(self) -> None:
        """Keep the newest spares up to SPARE_BYTES. Why keep any: a fill into fresh tensors faults in
        and zeroes new pages (a batch of 16 ragged requests regroups ~30 times while rows join and leave)."""
        keep, total = [], 0
        for bufs in reversed(self.spares):
            total += sum(t.numel() * t.element_size() for kv in bufs.values() for t in kv)
            if total > SPARE_BYTES:
                break
            keep.append(bufs)
        self.spares = keep[::-1]

    def _continue(self, m: _Mirror, g: AttnGroup, rows: list[list[int]], ctx: AttentionContext) -> bool:
        ps = self.page_size
        if max(g.ctx_lens) > m.cap or any(n != p + 1 for n, p in zip(g.ctx_lens, m.ctx_lens)):
            return False
        if any(r[:len(p)] != p for r, p in zip(rows, m.pages)):
            return False
        m.fill_index = None
        m.append_dst = torch.tensor([r * m.cap + n - 1 for r, n in enumerate(g.ctx_lens)], dtype=torch.long,
                                    device=g.page_index.device)
        m.append_src = _group_slots(ctx, g)
        m.ctx_lens, m.pages = list(g.ctx_lens), [r[:-(-n // ps)] for r, n in zip(rows, g.ctx_lens)]
        return True

    def _fill(self, g: AttnGroup, rows: list[list[int]], key: tuple[str, ...]) -> _Mirror:
        ps = self.page_size
        cap = -(-(max(g.ctx_lens) + GROW_SLOTS) // ps) * ps
        width = cap // ps  # padding pages (page 0) are overwritten by appends before a row reads them
        index = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long,
                             device=g.page_index.device).view(-1)
        pages = [r[:-(-n // ps)] for r, n in zip(rows, g.ctx_lens)]
        bufs = self._spare(g.batch * cap)
        return _Mirror(key, list(g.ctx_lens), pages, cap, bufs, fill_index=index)

    def _spare(self, slots: int) -> dict:
        """Buffers of a dropped copy big enough for `slots`, else new ones (made per layer on first use).
        Why: fresh multi-MB tensors are fresh pages from the OS (page faults) on every fill."""
        need = slots * self.cell_shape[0] * self.cell_shape[1]
        sizes = [next(iter(b.values()))[0].numel() if b else 0 for b in self.spares]
        fits = [i for i, n in enumerate(sizes) if n >= need]
        if not fits:
            return {}
        return self.spares.pop(min(fits, key=sizes.__getitem__))

    def load(self, layer: int, g: AttnGroup, k_pool: torch.Tensor, v_pool: torch.Tensor,
             written: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K, V [B, ctx, kv_heads, cell] from the group's copy, or None when the group has none.
        `written`: this layer's K, V of this step's packed tokens [num_tokens, kv_heads, cell] as just
        written to the pages (saves reading the new slots back from the pool), or None."""
        m = self._by_group.get(id(g))
        if m is None:
            return None
        b, (h, c) = g.batch, self.cell_shape
        bk = m.bufs.get(layer)
        if bk is None or bk[0].numel() < m.numel * h * c:
            bk = m.bufs[layer] = (k_pool.new_empty(m.numel * h * c), v_pool.new_empty(m.numel * h * c))
        out = []
        for i, (pool, buf) in enumerate(zip((k_pool, v_pool), bk)):
            dense = buf[:m.numel * h * c]
            if m.fill_index is not None:  # [num_pages, ps, h, c] -> B rows of cap slots
                torch.index_select(pool, 0, m.fill_index, out=dense.view(-1, self.page_size, h, c))
            else:
                dense.view(-1, h, c).index_copy_(0, m.append_dst, _new_rows(g, pool, m.append_src, written, i))
            out.append(dense.view(b, m.cap, h, c)[:, :max(g.ctx_lens)])
        return out[0], out[1]


def _new_rows(g: AttnGroup, pool: torch.Tensor, slots: torch.Tensor, written, i: int) -> torch.Tensor:
    """This step's K (i = 0) or V (1) of the group's rows, in row order: [B, kv_heads, cell]."""
    if written is None:
        return pool.view(-1, *pool.shape[2:]).index_select(0, slots)
    if g.token_rows is None:
        return written[i][g.token_start:g.token_end]
    return written[i].index_select(0, g.token_rows)


def _group_slots(ctx: AttentionContext, g: AttnGroup) -> torch.Tensor:
    """Flat pool slots written this step by the group's rows, in row order: [B]."""
    if g.token_rows is None:
        return ctx.write_slots[g.token_start:g.token_end]
    return ctx.write_slots.index_select(0, g.token_rows)
