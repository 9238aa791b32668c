"""Pure-Python page allocator: pages with owners and reference counts, and leased reservations.

Owned by whoever holds a page pool (`engine.LLM`, a prefill or decode worker). An owner is any string:
a sequence (`seq:<request id>`), a held prefill result, or a reservation (`res:<id>`) for KV that is
arriving over the wire or leaving. A page is free when no owner references it; shared prefixes give a
page several owners. Reservations hold pages under a lease read from an injectable clock, so tests
expire them without sleeping. Order of use: `reserve()` -> (`renew()`)* -> `commit()` to a sequence, or
`cancel()`; `expire()` frees lapsed leases.

One owner may be a cache (`attach_cache`, the prefix cache in `prefix_cache.py`): a page only the cache
holds is not in use but evictable. Such pages queue in least-recently-released order and count as free;
`allocate()` evicts from the front of that queue (telling the cache, which forgets the page) when the free
list runs short. A page any other owner still holds is never evicted.

Partitions (`partitions` > 1: expert parallelism with data-parallel attention, where each attention rank holds
its own page pool): page ids [p * P, (p + 1) * P) live in partition p's pool, and every owner but the cache
keeps all of its pages in one partition -- the one of the pages it already holds (a shared cached prefix, a
committed reservation), else the one with the most free pages when it first allocates. Free lists and eviction
are per partition; `num_free_for(owner)` is what a check before `allocate` must read. One partition (the
default) is the plain single pool.
"""
from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from itertools import islice
from typing import Callable

from engine.errors import OutOfPagesError, ReservationError

Clock = Callable[[], float]


@dataclass
class Reservation:
    reservation_id: str
    nonce: str
    pages: list[int]
    expires_at: float
    num_shared: int = 0  # leading pages shared from elsewhere (cached prefix): their KV is there already

    @property
    def owner(self) -> str:
        return f"res:{self.reservation_id}"


class PageAllocator:
    def __init__(self, num_pages: int, clock: Clock = time.monotonic, remember_finished: int = 4096,
                 partitions: int = 1):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if partitions < 1 or num_pages % partitions:
            raise ValueError(f"{partitions} partitions do not divide {num_pages} pages")
        self.num_pages = num_pages
        self.clock = clock
        self.partitions, self.partition_pages = partitions, num_pages // partitions
        # per partition; pop() hands out low ids first
        self._free: list[list[int]] = [list(range((p + 1) * self.partition_pages - 1, p * self.partition_pages - 1, -1))
                                       for p in range(partitions)]
        self._num_evictable = [0] * partitions
        self._owners: list[set[str]] = [set() for _ in range(num_pages)]
        self._owned: dict[str, set[int]] = {}
        self._reservations: dict[str, Reservation] = {}
        # Why a reservation ended, so a late chunk gets "expired"/"finished" rather than "unknown".
        self._finished: OrderedDict[str, str] = OrderedDict()
        self._remember = remember_finished
        self._cache_owner: str | None = None
        self._on_evict: Callable[[int], None] | None = None
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cache-only pages, least recently released first
        self._on_unheld: list[Callable[[int], None]] = []
        self._on_free: list[Callable[[int], None]] = []

    def add_free_hook(self, fn: Callable[[int], None]) -> None:
        """`fn(page)` runs when a page goes back on the free list (its contents mean nothing any more:
        sparse attention's page summaries reset)."""
        self._on_free.append(fn)

    def add_unheld_hook(self, fn: Callable[[int], None]) -> None:
        """`fn(page)` runs when a page stops being held by any owner but the cache (freed, or left to the
        cache): nothing will write it again (the kivi4 backend drops its full-precision staging copy)."""
        self._on_unheld.append(fn)

    def attach_cache(self, owner: str, on_evict: Callable[[int], None]) -> None:
        """Make `owner` a cache whose sole-owned pages are evictable; `on_evict(page)` runs before one goes."""
        assert self._cache_owner is None, "one cache per allocator"
        self._cache_owner, self._on_evict = owner, on_evict

    # ---- plain pages -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages free in all partitions: the free lists plus cache-only (evictable) pages (what one allocation can
        get with one partition; with more, see `num_free_for`)."""
        return sum(map(len, self._free)) + len(self._evictable)

    def free_pages(self) -> list[int]:
        """Every page on a free list (not the evictable ones), ascending."""
        return sorted(p for free in self._free for p in free)

    def partition_of(self, page: int) -> int:
        return page // self.partition_pages

    def owner_partition(self, owner: str) -> int | None:
        """The partition `owner`'s pages live in; None while it holds none."""
        pages = self._owned.get(owner)
        return self.partition_of(next(iter(pages))) if pages else None

    def num_free_in(self, partition: int) -> int:
        return len(self._free[partition]) + self._num_evictable[partition]

    def num_free_for(self, owner: str) -> int:
        """Pages `allocate(owner, n)` can get now: its partition's free pages (the most any partition has, for
        an owner holding none yet)."""
        p = self.owner_partition(owner) if self.partitions > 1 else 0
        return self.num_free_in(p) if p is not None else max(map(self.num_free_in, range(self.partitions)))

    def _partition_for(self, owner: str) -> int:
        p = self.owner_partition(owner) if self.partitions > 1 else 0
        if p is None:  # a new owner: the partition with the most free pages (the lowest on a tie)
            p = max(range(self.partitions), key=lambda q: (self.num_free_in(q), -q))
        return p

    @property
    def num_in_use(self) -> int:
        """Pages some owner other than the cache holds (or a reservation)."""
        return self.num_pages - self.num_free

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def is_evictable(self, page: int) -> bool:
        return page in self._evictable

    def evict(self, n: int, partition: int | None = None) -> int:
        """Give up to `n` least recently released cache-only pages (of `partition`, or any) back to the free
        list; how many went."""
        pool = iter(self._evictable) if partition is None or self.partitions == 1 else \
            (p for p in self._evictable if self.partition_of(p) == partition)
        pick = list(islice(pool, max(n, 0)))  # (taken first: eviction changes the queue)
        for page in pick:
            self._on_evict(page)
            self._drop_ref(self._cache_owner, page)  # the last reference: the page is free now
        return len(pick)

    def refcount(self, page: int) -> int:
        return len(self._owners[page])

    def pages_of(self, owner: str) -> set[int]:
        return set(self._owned.get(owner, ()))

    def allocate(self, owner: str, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        p = self._partition_for(owner)
        if n > self.num_free_in(p):
            where = f" in partition {p} of {self.partitions}" if self.partitions > 1 else ""
            raise OutOfPagesError(f"need {n} pages, {self.num_free_in(p)} free{where} of {self.num_pages}")
        free = self._free[p]
        self.evict(n - len(free), p)
        pages = [free.pop() for _ in range(n)]
        for p in pages:
            self._add_ref(owner, p)
        return pages

    def share(self, owner: str, pages: list[int]) -> None:
        """Give `owner` a reference to pages someone already holds (shared prefixes)."""
        if self.partitions > 1 and owner != self._cache_owner:
            self._check_partition(owner, pages)
        for p in pages:
            assert self._owners[p], f"page {p} is free; share only held pages"
            self._add_ref(owner, p)

    def release(self, owner: str, pages: list[int]) -> None:
        for p in pages:
            self._drop_ref(owner, p)

    def release_owner(self, owner: str) -> int:
        """Drop every reference `owner` holds; returns how many references were dropped."""
        pages = list(self._owned.get(owner, ()))
        self.release(owner, pages)
        return len(pages)

    def transfer(self, old_owner: str, new_owner: str) -> list[int]:
        """Move every reference of `old_owner` to `new_owner` (no page is freed on the way)."""
        pages = sorted(self._owned.get(old_owner, ()))
        for p in pages:
            self._add_ref(new_owner, p)
            self._drop_ref(old_owner, p)
        return pages

    def _add_ref(self, owner: str, page: int) -> None:
        assert owner not in self._owners[page], f"{owner} already holds page {page}"
        if self.partitions > 1 and owner != self._cache_owner:
            self._check_partition(owner, [page])
        if self._evictable.pop(page, 0) is None:  # someone besides the cache holds it again
            self._num_evictable[self.partition_of(page)] -= 1
        self._owners[page].add(owner)
        self._owned.setdefault(owner, set()).add(page)

    def _check_partition(self, owner: str, pages: list[int]) -> None:
        """ValueError (before any change) unless `pages` and what `owner` holds are all in one partition."""
        held = self.owner_partition(owner)
        parts = {self.partition_of(p) for p in pages} | ({held} if held is not None else set())
        if len(parts) > 1:
            raise ValueError(f"{owner} would hold pages of partitions {sorted(parts)}: an owner's pages share one "
                             f"partition")

    def _drop_ref(self, owner: str, page: int) -> None:
        assert owner in self._owners[page], f"{owner} does not hold page {page}"
        self._owners[page].discard(owner)
        held = self._owned[owner]
        held.discard(page)
        if not held:
            del self._owned[owner]
        owners = self._owners[page]
        if not owners:
            if self._evictable.pop(page, 0) is None:
                self._num_evictable[self.partition_of(page)] -= 1
            self._free[self.partition_of(page)].append(page)
            for fn in self._on_free:
                fn(page)
        elif self._cache_owner in owners and len(owners) == 1:
            if page not in self._evictable:
                self._num_evictable[self.partition_of(page)] += 1
            self._evictable[page] = None  # newest at the back: evicted last
        else:
            return
        for fn in self._on_unheld:  # (idempotent for the hooks: a cached page evicted later calls it again)
            fn(page)

    # ---- reservations ------------------------------------------------------------------------
    @property
    def num_reservations(self) -> int:
        return len(self._reservations)

    def reserve(self, n: int, lease_s: float, shared: list[int] = ()) -> Reservation:
        """Hold `n` new pages, after `shared` held pages (a cached prefix) the reservation references too."""
        rid = secrets.token_hex(8)
        res = Reservation(rid, secrets.token_hex(16), [], self.clock() + lease_s, len(shared))
        self.share(res.owner, list(shared))  # first: shared pages stop being evictable, so free counts true
        try:
            res.pages = list(shared) + self.allocate(res.owner, n)
        except OutOfPagesError:
            self.release(res.owner, list(shared))
            raise
        self._reservations[rid] = res
        return res

    def get_reservation(self, reservation_id: str) -> Reservation:
        """The live reservation, or ReservationError saying why it is not live."""
        self.expire()
        res = self._reservations.get(reservation_id)
        if res is None:
            why = self._finished.get(reservation_id, "unknown")
            raise ReservationError(f"reservation {reservation_id} is {why}")
        return res

    def renew(self, reservation_id: str, lease_s: float) -> None:
        self.get_reservation(reservation_id).expires_at = self.clock() + lease_s

    def commit(self, reservation_id: str, new_owner: str) -> list[int]:
        """End the reservation, handing its pages (in reservation order) to `new_owner`."""
        res = self.get_reservation(reservation_id)
        self.transfer(res.owner, new_owner)
        self._end(reservation_id, "committed")
        return list(res.pages)

    def cancel(self, reservation_id: str, why: str = "cancelled") -> None:
        res = self._reservations.get(reservation_id)
        if res is None:
            return
        self.release_owner(res.owner)
        self._end(reservation_id, why)

    def expire(self) -> list[str]:
        now = self.clock()
        lapsed = [rid for rid, r in self._reservations.items() if r.expires_at <= now]
        for rid in lapsed:
            self.cancel(rid, "expired")
        return lapsed

    def finished_reason(self, reservation_id: str) -> str | None:
        return self._finished.get(reservation_id)

    def _end(self, reservation_id: str, why: str) -> None:
        del self._reservations[reservation_id]
        self._finished[reservation_id] = why
        while len(self._finished) > self._remember:
            self._finished.popitem(last=False)
