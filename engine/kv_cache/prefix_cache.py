"""Prefix cache: full KV pages found again by a hash chain of their tokens, shared by reference count.

Owned by `engine.LLM` when `enable_prefix_caching` is on; the `Scheduler` drives it through
`PrefixSharing`. Life of a cached page:
  1. a sequence fills a page with tokens that are final (computed, never to be rolled back); at the next
     `schedule()` (or when the sequence is preempted or ends) `PrefixSharing.register` hashes it,
     blake2b(hash of the previous page + this page's token ids), and the cache takes a reference to it
     (allocator owner `CACHE_OWNER`);
  2. a waiting request whose tokens hash to the same chain gets those pages shared into its new block
     table at admission (`probe` -> `admit`) and starts computing after them. At least its last token is
     always left to compute (a logits row to sample from): a prompt cached up to its very end recomputes
     its last page into a page of its own;
  3. when no sequence holds the page any more it stays cached but evictable; the allocator counts it as
     free and evicts such pages, least recently released first, when an allocation needs them
     (`PrefixCache._on_evict` forgets the hash). A page a sequence or reservation holds is never evicted;
  4. `reset()` drops every cache reference (pages in use stay with their sequences and are registered
     again at the next step).
The chain starts from a salt of the model fingerprint and the KV page layout (signature with the storage
format, and the page size), so caches of different models or formats never mix. The last, partially
filled page of a sequence is never registered, so no one writes into a shared page (copy on write by
recompute; `rollback` keeps it so when a sequence rolls back into a shared page).

Seams for prefix-aware routing and the disaggregated path: `page_hashes(tokens, page_size, salt)` names
a token list's full pages; `PrefixCache.cached_prefix_tokens(tokens)` says how many leading tokens a pool
holds; `PrefixCache.hashes()` lists every cached page's chain hash. Pure Python: no torch.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Callable, Sequence

from engine.kv_cache.allocator import PageAllocator
from engine.kv_cache.block_table import BlockTables
from engine.request import Request

CACHE_OWNER = "cache:prefix"
_DIGEST = 16  # bytes: 128-bit chain hashes; a collision would serve the wrong KV, so not shorter


def prefix_salt(model_fingerprint: str, layout_signature: str, page_size: int) -> bytes:
    """Root of every hash chain of one page pool: weights + dtype, KV layout and format, page size."""
    text = f"pdserve-prefix-v1/{model_fingerprint}/{layout_signature}/{page_size}"
    return hashlib.blake2b(text.encode(), digest_size=_DIGEST).digest()


def chain_hash(prev: bytes, tokens: Sequence[int]) -> bytes:
    """Hash of one full page: its predecessor's hash and its token ids (uint32 little-endian)."""
    h = hashlib.blake2b(prev, digest_size=_DIGEST)
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return h.digest()


def page_hashes(tokens: Sequence[int], page_size: int, salt: bytes, start: Sequence[bytes] = ()) -> list[bytes]:
    """Chain hashes of every full page of `tokens`, continuing `start` (the hashes of its first pages)."""
    out = list(start)
    prev = out[-1] if out else salt
    for i in range(len(out), len(tokens) // page_size):
        prev = chain_hash(prev, tokens[i * page_size:(i + 1) * page_size])
        out.append(prev)
    return out


@dataclass
class PrefixStats:
    queries: int = 0  # admissions that looked the cache up
    queried_tokens: int = 0  # tokens those admissions brought (prompt, plus outputs on a recompute)
    hit_tokens: int = 0  # of those, tokens found cached (= prefill tokens not computed)
    inserted_pages: int = 0
    evicted_pages: int = 0  # given back under page pressure
    reset_pages: int = 0  # dropped by reset()
    shared_received_pages: int = 0  # disaggregated: cached pages a prefilled request joined on, not shipped

    def as_dict(self) -> dict[str, float]:
        d = dict(vars(self))
        d["hit_rate"] = self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
        d["prefill_tokens_saved"] = self.hit_tokens
        return d


class PrefixCache:
    """Chain hash <-> page maps over one allocator; the cache's references are the allocator's."""

    def __init__(self, allocator: PageAllocator, page_size: int, salt: bytes):
        self.allocator, self.page_size, self.salt = allocator, page_size, salt
        # chain hash -> page, one map per pool of a partitioned allocator (data-parallel attention: each pool
        # caches its own copy of a popular prefix; a sequence's pages never span pools)
        self._pools: list[dict[bytes, int]] = [{} for _ in range(allocator.partitions)]
        self._hash_of: dict[int, bytes] = {}
        self.stats = PrefixStats()
        allocator.attach_cache(CACHE_OWNER, self._on_evict)

    def __len__(self) -> int:
        return len(self._hash_of)

    @property
    def num_evictable(self) -> int:
        return self.allocator.num_evictable

    def _chains(self, tokens: Sequence[int], max_pages: int | None) -> tuple[list[list[int]], list[bytes]]:
        """Each pool's cached pages of the longest full-page prefix of `tokens` it holds, and the chain hashes.
        Hashes page by page and stops once no pool holds the next (a long prompt that misses early costs little)."""
        n = len(tokens) // self.page_size
        if max_pages is not None:
            n = min(n, max_pages)
        pages: list[list[int]] = [[] for _ in self._pools]
        hashes, prev, live = [], self.salt, list(range(len(self._pools)))
        for i in range(n):
            prev = chain_hash(prev, tokens[i * self.page_size:(i + 1) * self.page_size])
            live = [p for p in live if prev in self._pools[p]]
            if not live:
                break
            for p in live:
                pages[p].append(self._pools[p][prev])
            hashes.append(prev)
        return pages, hashes

    def lookup(self, tokens: Sequence[int], max_pages: int | None = None) -> tuple[list[int], list[bytes]]:
        """Pages and hashes of the longest cached full-page prefix of `tokens` (in one pool: the longest such
        chain, the lowest pool on a tie); takes no reference."""
        pages, hashes = self._chains(tokens, max_pages)
        best = max(pages, key=len)
        return best, hashes[:len(best)]

    def lookup_to_admit(self, tokens: Sequence[int], max_pages: int) -> tuple[list[int], list[bytes]]:
        """`lookup` for a request about to start on the prefix. With partitioned pools a hit pins the request to
        its pool, so a pool's chain counts only while that pool has at least half the free pages of the
        emptiest: a popular prefix does not pile every request onto one pool (one attention rank) while another
        idles; the request then starts afresh where pages are free and that pool caches its own copy. Of equal
        chains, the pool with more free pages."""
        pages, hashes = self._chains(tokens, max_pages)
        alloc = self.allocator
        if alloc.partitions == 1:
            return pages[0], hashes[:len(pages[0])]
        free = [alloc.num_free_in(p) for p in range(alloc.partitions)]
        usable = [chain if 2 * free[p] >= max(free) else [] for p, chain in enumerate(pages)]
        best = max(range(alloc.partitions), key=lambda p: (len(usable[p]), free[p]))
        return usable[best], hashes[:len(usable[best])]

    def cached_prefix_tokens(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` this pool holds KV for (whole pages)."""
        return len(self.lookup(tokens)[0]) * self.page_size

    def hashes(self) -> list[bytes]:
        """Every cached chain hash (once, whichever pools hold it)."""
        return list(dict.fromkeys(h for pool in self._pools for h in pool))

    def info(self) -> dict:
        """What a router's prefix index needs to name this pool's pages with the same chain (plain data:
        it crosses to the router): the salt (hex), the page size, and the page count (index capacity)."""
        return {"prefix_salt": self.salt.hex(), "page_size": self.page_size, "num_pages": self.allocator.num_pages}

    def page_of(self, h: bytes) -> int | None:
        return next((pool[h] for pool in self._pools if h in pool), None)

    def insert(self, h: bytes, page: int) -> bool:
        """Cache `page` (held by its sequence) under chain hash `h`. False if its pool caches `h` already: two
        requests computed the same page at once, and the first copy stays (the other goes with its owner)."""
        pool = self._pools[self.allocator.partition_of(page)]
        if h in pool:
            return False
        assert page not in self._hash_of, f"page {page} is cached under another hash"
        self.allocator.share(CACHE_OWNER, [page])
        pool[h] = page
        self._hash_of[page] = h
        self.stats.inserted_pages += 1
        return True

    def reset(self) -> int:
        """Forget every cached page: cache-only pages go back to the free list; returns how many were cached."""
        n = len(self._hash_of)
        for pool in self._pools:
            pool.clear()
        self._hash_of.clear()
        self.allocator.release_owner(CACHE_OWNER)
        self.stats.reset_pages += n
        return n

    def _on_evict(self, page: int) -> None:
        """The allocator is about to free `page` (only the cache held it): forget its hash."""
        del self._pools[self.allocator.partition_of(page)][self._hash_of.pop(page)]
        self.stats.evicted_pages += 1


@dataclass
class PrefixHit:
    pages: list[int]  # cached pages covering the request's first len(pages) * page_size tokens
    hashes: list[bytes]
    num_evictable: int  # of those, pages only the cache holds: they stop counting as free once shared


class PrefixSharing:
    """The scheduler's side: share cached pages into admitted requests, register final full pages.

    `cacheable(req)` says whether a request may take part: the engine excludes requests whose KV gets
    evicted/compacted (their slots stop matching their tokens). Per sequence it keeps the chain hashes of
    the full final pages registered (or shared) so far, so each page is hashed once."""

    def __init__(self, cache: PrefixCache, tables: BlockTables, cacheable: Callable[[Request], bool]):
        assert tables.page_size == cache.page_size and tables.allocator is cache.allocator
        self.cache, self.tables, self.cacheable = cache, tables, cacheable
        self.page_size = cache.page_size
        self._hashes: dict[str, list[bytes]] = {}

    def probe(self, req: Request) -> PrefixHit | None:
        """The cached prefix a waiting request could start from; None if it does not take part."""
        if req.num_computed or req.request_id in self.tables or not self.cacheable(req):
            # (prefill-only requests share too: the KV sender reads the cached pages they start on by slot,
            # for the part the decode side lacks -- kv_transfer/sender.py)
            return None
        pages, hashes = self.cache.lookup_to_admit(req.token_ids, (len(req.token_ids) - 1) // self.page_size)
        alloc = self.tables.allocator
        return PrefixHit(pages, hashes, sum(1 for p in pages if alloc.is_evictable(p)))

    def pages_short(self, req: Request, n: int, hit: PrefixHit | None) -> bool:
        """Would admitting `req` with `n` new tokens (after the hit) need more pages than are free?"""
        alloc = self.tables.allocator
        if hit is None or not hit.pages:
            return not self.tables.fits(req.request_id, n)
        need = self.tables.pages_for(len(hit.pages) * self.page_size + n) - len(hit.pages)
        return need + hit.num_evictable > alloc.num_free_in(alloc.partition_of(hit.pages[0]))  # the hit's pool

    def admit(self, req: Request, hit: PrefixHit | None) -> int:
        """Share the hit into `req`'s new block table; how many of its tokens need no computing."""
        if hit is None:
            return 0
        st = self.cache.stats
        st.queries += 1
        st.queried_tokens += len(req.token_ids)
        self._hashes[req.request_id] = list(hit.hashes)
        if not hit.pages:
            return 0
        self.tables.share_prefix(req.request_id, hit.pages)
        st.hit_tokens += len(hit.pages) * self.page_size
        return len(hit.pages) * self.page_size

    def register(self, req: Request) -> None:
        """Cache every page of `req` whose tokens all have final KV (computed; drafts are not counted in
        `num_computed` until accepted) and that is not cached yet."""
        rid, ps = req.request_id, self.page_size
        if rid not in self.tables or not self.cacheable(req):
            return
        table = self.tables.get(rid)
        if table.num_slots < req.num_computed:
            return  # KV thinned: slots no longer line up with tokens
        done = self._hashes.setdefault(rid, [])
        full = min(req.num_computed, len(req.token_ids)) // ps
        if full <= len(done):
            return
        hashes = page_hashes(req.token_ids[:full * ps], ps, self.cache.salt, done)
        for i in range(len(done), full):
            self.cache.insert(hashes[i], table.pages[i])
        self._hashes[rid] = hashes

    def rollback(self, req: Request, num_tokens: int) -> int:
        """`req` drops computed tokens back to `num_tokens`; how many computed tokens it may keep. If the
        page the cut falls in is shared (cached), keeping part of it would mean writing into a shared page
        later: keep only the whole pages before it and recompute the rest into a page of its own."""
        ps = self.page_size
        done = self._hashes.get(req.request_id)
        if done:
            del done[num_tokens // ps:]
        table = self.tables.get(req.request_id)
        j = num_tokens // ps
        if num_tokens % ps and j < len(table.pages) and self.tables.allocator.refcount(table.pages[j]) > 1:
            return j * ps
        return num_tokens

    def forget(self, request_id: str) -> None:
        self._hashes.pop(request_id, None)

    def reset(self) -> int:
        """Empty the cache; running requests register their full pages again at the next step."""
        self._hashes.clear()
        return self.cache.reset()
