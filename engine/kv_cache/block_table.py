"""Per-sequence page tables over a `PageAllocator`.

The scheduler owns one `BlockTables`. A sequence's KV lives in `num_slots` physical slots spread over its
pages in order (slot i is offset i % page_size of page i // page_size). Physical slots are not logical
positions: after eviction a sequence keeps fewer slots than it has positions, which is why the runner
takes positions separately. `truncate` rolls back slots (rejected draft tokens) and frees whole pages
left unused (and tells `on_truncate` hooks which kept page lost slots: sparse attention's page summaries
are recomputed). `share_prefix` starts a table on full pages someone else holds (prefix cache hits); the
sequence only ever writes past them, into pages of its own. Each table remembers the most pages it held
at once (`peak_pages`, drafts and shared prefix pages included), kept a while after `free` (the last
`_REMEMBER` sequences; a preempted sequence that comes back continues from it) for per-request metrics.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from engine.kv_cache.allocator import PageAllocator


def seq_owner(seq_id: str) -> str:
    return f"seq:{seq_id}"


@dataclass
class BlockTable:
    pages: list[int] = field(default_factory=list)
    num_slots: int = 0
    peak_pages: int = 0  # the most pages held at once


_REMEMBER = 4096  # freed sequences whose peak stays readable


class BlockTables:
    def __init__(self, allocator: PageAllocator, page_size: int):
        self.allocator = allocator
        self.page_size = page_size
        self._tables: dict[str, BlockTable] = {}
        self._peaks: OrderedDict[str, int] = OrderedDict()  # freed sequences' peak_pages, the last _REMEMBER
        self.on_truncate: list[Callable[[int, int], None]] = []  # fn(page, filled): a kept page lost slots

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._tables

    def __len__(self) -> int:
        return len(self._tables)

    def get(self, seq_id: str) -> BlockTable:
        return self._tables[seq_id]

    def pages_for(self, num_slots: int) -> int:
        return -(-num_slots // self.page_size)

    def extra_pages_needed(self, seq_id: str, new_slots: int) -> int:
        t = self._tables.get(seq_id)
        have_pages = len(t.pages) if t else 0
        have_slots = t.num_slots if t else 0
        return max(0, self.pages_for(have_slots + new_slots) - have_pages)

    def fits(self, seq_id: str, new_slots: int) -> bool:
        """Can `seq_id` grow by `new_slots` slots now (from its partition's pool, `PageAllocator`)?"""
        return self.extra_pages_needed(seq_id, new_slots) <= self.allocator.num_free_for(seq_owner(seq_id))

    def append(self, seq_id: str, new_slots: int) -> BlockTable:
        """Grow the sequence by `new_slots` slots, allocating pages (OutOfPagesError if none)."""
        t = self._tables.get(seq_id) or self._new(seq_id, [], 0)
        extra = self.extra_pages_needed(seq_id, new_slots)
        if extra:
            t.pages.extend(self.allocator.allocate(seq_owner(seq_id), extra))
            t.peak_pages = max(t.peak_pages, len(t.pages))
        t.num_slots += new_slots
        return t

    def _new(self, seq_id: str, pages: list[int], num_slots: int) -> BlockTable:
        t = self._tables[seq_id] = BlockTable(list(pages), num_slots, max(len(pages), self._peaks.pop(seq_id, 0)))
        return t

    def peak_pages(self, seq_id: str) -> int:
        """The most pages `seq_id` held at once (live, or freed lately; 0 if unknown)."""
        t = self._tables.get(seq_id)
        return t.peak_pages if t is not None else self._peaks.get(seq_id, 0)

    def adopt(self, seq_id: str, pages: list[int], num_slots: int) -> None:
        """Take pages the allocator already assigned to `seq_owner(seq_id)` (committed reservation)."""
        assert seq_id not in self._tables, f"{seq_id} already has a block table"
        assert len(pages) == self.pages_for(num_slots), (len(pages), num_slots)
        self._new(seq_id, pages, num_slots)

    def share_prefix(self, seq_id: str, pages: list[int]) -> BlockTable:
        """Start `seq_id`'s table on full `pages` already held elsewhere (cached prefix), one reference each."""
        assert seq_id not in self._tables, f"{seq_id} already has a block table"
        self.allocator.share(seq_owner(seq_id), pages)
        return self._new(seq_id, pages, len(pages) * self.page_size)

    def truncate(self, seq_id: str, num_slots: int) -> None:
        t = self._tables[seq_id]
        assert 0 <= num_slots <= t.num_slots, (num_slots, t.num_slots)
        keep = self.pages_for(num_slots)
        dropped, t.pages = t.pages[keep:], t.pages[:keep]
        self.allocator.release(seq_owner(seq_id), dropped[::-1])
        if num_slots % self.page_size and num_slots < t.num_slots:  # the last kept page keeps part of its slots
            for fn in self.on_truncate:
                fn(t.pages[-1], num_slots % self.page_size)
        t.num_slots = num_slots

    def free(self, seq_id: str) -> None:
        t = self._tables.pop(seq_id, None)
        if t is not None:
            self._peaks[seq_id] = t.peak_pages
            while len(self._peaks) > _REMEMBER:
                self._peaks.popitem(last=False)
            # Last page first: a cache keeps pages in release order, so a prefix's tail is evicted before
            # its head (a head page without its tail still serves a shorter prefix; the reverse serves none).
            self.allocator.release(seq_owner(seq_id), t.pages[::-1])

    def slots(self, seq_id: str, start: int, count: int) -> list[int]:
        """Flat slot ids (page * page_size + offset) of slots [start, start + count)."""
        t, ps = self._tables[seq_id], self.page_size
        return [t.pages[i // ps] * ps + i % ps for i in range(start, start + count)]
