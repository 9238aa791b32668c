"""Page summaries for sparse decode attention: per page, layer and KV head, the channel-wise min and max of
the keys (after RoPE) in the page's filled slots -- what Quest needs to bound q . k over a page.

Owned by a KV backend (`backend.summaries`, made by `enable_summaries()`; None, and no cost, while sparse
attention is off). Who keeps it true, and when:
  - `RawKVBackend.write` / `QuantizedKVBackend.write` -> `update(layer, slots)` after the cells are stored;
  - `page_io.import_kv` (KV received over the wire: rebuilt on the receiving side from the imported cells,
    nothing extra on the wire) -> `update_range(layer, pages, start, stop)`;
  - `eviction.compact` (survivors moved down a sequence's pages) -> `rebuild(pages, num_slots)`;
  - `BlockTables.truncate` (rejected drafts, evictor, `num_slots` joins) -> `truncate(page, filled)` for the
    last page it keeps partly filled;
  - `PageAllocator` free hook (a page back on the free list: preemption, finish, prefix-cache eviction)
    -> `reset(page)`.
Pages shared by prefix caching are one page: their summary is shared with them.

How a summary stays exact: each page has an extent (slots [0, extent) are filled; one count for every
layer, since a sequence writes the same slots in each). A write raises the extent of the pages it touches
to the end of what it wrote there and recomputes those pages' min/max from the stored keys over
[0, extent) -- not an incremental fold, so a write after a rollback (the same slots written again) drops
the rolled-back keys, and chunks arriving out of order or by KV-head range converge once all have arrived.
Cost: one gather of the touched pages per layer per write (a decode step: batch pages of page_size slots).

What is summarised: the keys attention reads. Raw pages: the stored keys (min/max of bf16 values are bf16
values: kept in the key dtype, exact). int8/fp8 pages: the dequantized keys in the Hadamard-rotated space
the cells live in (the backend rotates queries into that space before scoring, as it does for attention),
so the bounds hold for exactly the keys attention sees. kivi4 is not supported (the last page lives in
staging). Memory: 2 x kv_heads x head_dim values per page and layer (`KVPageSpec.summary_bytes_per_page`):
2 / page_size of the K pages, 1 / page_size of K + V (6.25% at 16-token pages).
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from engine.kv_cache.spec import KVPageSpec

PageKeys = Callable[[int, torch.Tensor], torch.Tensor]  # (layer, pages [P]) -> keys [P, page_size, kv_heads, head_dim]


class PageSummaries:
    def __init__(self, spec: KVPageSpec, num_pages: int, dtype: torch.dtype, page_keys: PageKeys,
                 device: str | torch.device = "cpu"):
        self.spec = spec
        self.page_keys = page_keys
        shape = (num_pages, spec.num_kv_heads, spec.head_dim)
        self.lo: list[torch.Tensor | None] = [None] * spec.num_layers  # [num_pages, kv_heads, head_dim]
        self.hi: list[torch.Tensor | None] = [None] * spec.num_layers
        for layer in spec.local_layers:
            self.lo[layer] = torch.full(shape, float("inf"), dtype=dtype, device=device)
            self.hi[layer] = torch.full(shape, float("-inf"), dtype=dtype, device=device)
        self.extent = np.zeros(num_pages, dtype=np.int64)  # filled slots [0, extent) of each page
        self._plan: tuple | None = None  # (slots, pages, their extents) of the last `update`: one per step

    def nbytes(self) -> int:
        return sum(2 * t.numel() * t.element_size() for t in self.lo if t is not None)

    # ---- writes ------------------------------------------------------------------------------
    def update(self, layer: int, slots: torch.Tensor) -> None:
        """After `slots` (flat slot ids, [n]) of `layer` were written: recompute the pages they touch."""
        plan = self._plan
        if plan is None or plan[0] is not slots:  # every layer of a step writes the same slots tensor
            ps = self.spec.page_size
            s = slots.cpu().numpy()
            pages, ends = s // ps, s % ps + 1
            np.maximum.at(self.extent, pages, ends)
            uniq = np.unique(pages)
            plan = self._plan = (slots, *self._on_device(uniq))  # one host copy a step, not one a layer
        self._recompute(layer, plan[1], plan[2])

    def plan_writes(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The host's half of a write whose device half runs elsewhere (a static decode step, replayed as a
        CUDA graph): extents raised for `slots`; (their pages, those pages' extents) for `use_plan`."""
        ps = self.spec.page_size
        pages = slots // ps
        np.maximum.at(self.extent, pages, slots % ps + 1)
        return pages, self.extent[pages]

    def use_plan(self, slots: torch.Tensor, pages: torch.Tensor, ext: torch.Tensor) -> None:
        """Every layer's `update(layer, slots)` of the coming step recomputes `pages` ([n] device ids, repeats
        allowed: they get the same values) with extents `ext`, without a host copy."""
        self._plan = (slots, pages, ext)

    def update_range(self, layer: int, pages: Sequence[int], start: int, stop: int) -> None:
        """After slots [start, stop) of a page list were written (`page_io.import_kv`)."""
        if stop <= start:
            return
        ps = self.spec.page_size
        touched = []
        for i in range(start // ps, -(-stop // ps)):
            p = pages[i]
            self.extent[p] = max(self.extent[p], min(stop - i * ps, ps))
            touched.append(p)
        self._recompute(layer, *self._on_device(np.array(touched, dtype=np.int64)))

    def rebuild(self, pages: Sequence[int], num_slots: int) -> None:
        """A sequence's pages now hold slots [0, num_slots) in order (after compaction): every layer."""
        ps = self.spec.page_size
        self._plan = None
        used = list(pages[:-(-num_slots // ps)])
        for i, p in enumerate(used):
            self.extent[p] = min(ps, num_slots - i * ps)
        self._recompute_all(used)

    # ---- page life cycle ---------------------------------------------------------------------
    def truncate(self, page: int, filled: int) -> None:
        """The page keeps slots [0, filled) only (rollback): shrink its extent, recompute every layer."""
        self._plan = None
        if filled < self.extent[page]:
            self.extent[page] = filled
            self._recompute_all([page])

    def reset(self, page: int) -> None:
        """The page is free: nothing of it is filled (its next owner writes from slot 0)."""
        self.extent[page] = 0
        self._plan = None  # (a stale plan would keep a freed page's extent out of the next step's update)
        for layer in self.spec.local_layers:
            self.lo[layer][page] = float("inf")
            self.hi[layer][page] = float("-inf")

    # ---- the summary ------------------------------------------------------------------------
    def _recompute_all(self, pages: list[int]) -> None:
        if pages:
            idx, ext = self._on_device(np.array(pages, dtype=np.int64))
            for layer in self.spec.local_layers:
                self._recompute(layer, idx, ext)

    def _on_device(self, pages: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Page ids (host) and their extents, as tensors beside the summaries."""
        dev = self.lo[self.spec.local_layers[0]].device
        return torch.from_numpy(pages).to(dev), torch.from_numpy(self.extent[pages]).to(dev)

    def _recompute(self, layer: int, pages: torch.Tensor, ext: torch.Tensor) -> None:
        """lo/hi of `pages` ([P] ids, their extents [P]) from their stored keys over slots [0, extent)."""
        keys = self.page_keys(layer, pages).to(self.lo[layer].dtype)  # [P, page_size, kv_heads, head_dim]
        empty = (torch.arange(keys.shape[1], device=keys.device).view(1, -1) >= ext.view(-1, 1))
        empty = empty.view(*empty.shape, 1, 1)  # [P, page_size, 1, 1]
        self.lo[layer].index_copy_(0, pages, keys.masked_fill(empty, float("inf")).amin(1))
        self.hi[layer].index_copy_(0, pages, keys.masked_fill(empty, float("-inf")).amax(1))

    def expected(self, layer: int, page: int, filled: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tests) min and max recomputed from the page's stored keys over [0, filled): [kv_heads, head_dim]."""
        keys = self.page_keys(layer, torch.tensor([page]))[0, :filled].to(self.lo[layer].dtype)
        return keys.amin(0), keys.amax(0)
