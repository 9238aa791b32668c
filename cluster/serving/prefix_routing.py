"""KV-aware routing: which worker most likely holds a prompt's prefix, weighed against its load.

Who calls it: the router's admission (`admission.py`) when it places a request (prefill pool: who computes the fewest uncached
tokens; decode pool: who needs the fewest KV bytes shipped). Pure Python, no clock; the only I/O is
`PrefixPlacer.refresh` asking workers (through the router's handles) what their caches hold.

    index = PrefixIndex(page_size=16, capacity_pages={"p0": 256})
    hashes = index.hashes(prompt_ids)              # one chained digest per full page of the prompt
    index.matched_tokens("p0", hashes)             # tokens of the longest recorded prefix on p0
    w = pick(["p0", "p1"], hashes, index, load={"p0": 900, "p1": 0}, prompt_len=len(prompt_ids))
    index.record(w, hashes)                        # the worker will now hold those pages
    index.forget("p0")                             # worker lost or restarted: it holds nothing

Why an index on the router (SGLang's cache-aware router, Dynamo's KV router keep one too) rather than
asking every worker on every request: asking costs a round trip per worker before the request can move,
and the answer is stale by the time the request lands anyway. The index is approximate by design — it
records what the router sent, bounded per worker by that worker's page count in LRU order (roughly how
the engine's prefix cache evicts), so it can claim a prefix the worker already evicted. That costs only
speed: the worker reports what it really holds when the request arrives and computes the rest.

Digests are the engine's own (`engine.kv_cache.prefix_cache.page_hashes`: every full page's token ids
chained onto the previous page's digest, from a salt of the model and KV layout), so equal digests mean
equal whole prefixes, and a worker's report of what its cache holds (`replace`) speaks the same names.
Partial last pages are not shared (the engine computes them itself), so they are not indexed.

Score (lower wins): load[w] + uncached tokens on w, both in prompt-token units (the prefill pool's load
is its queued prompt tokens: time to first token grows with the tokens ahead plus the tokens to compute).
`cache_weight` scales how much a cached token is worth against one queued token; ties go to the first
candidate, so callers pass candidates in their own preference order.

`PrefixPlacer` is what the router (`router.py`) holds: one index per pool whose workers run a prefix cache (their
`info["prefix"]`: the engine's salt, page size and page count, so digests are the engine's own), or none
when `RouterConfig.prefix_routing` is False / no worker caches. Decode pool: `decode_order` ranks the
workers that have the pages for the uncached part (never one without), by load (requests in flight x
`decode_load_tokens`) + uncached tokens (KV bytes still to ship). Prefill pool: `pick_prefill` by queued
uncached prompt tokens + this prompt's uncached tokens; colocated pool: `pick_colocated` (load as for
decode). `record` after each placement (and `record_output` when a request completes: the decode side
caches the answer's pages too, which a next chat turn repeats), `forget` on a worker's loss, `refresh`
every `RouterConfig.prefix_refresh_s` (the workers' own reports replace the guess); `extra()`
adds routing counters and pool totals of the workers' prefix stats to `BackendStats.extra` (hence
/metrics and the bench's server counter table).
"""
from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any, Hashable, Iterable, Mapping, Sequence

from engine.errors import PdserveError

from engine.kv_cache.prefix_cache import page_hashes  # pure Python: the engine's own chain, no torch

Digest = bytes


class PrefixIndex:
    """Per worker, an LRU set of page-chain digests the router sent there."""

    def __init__(self, page_size: int, capacity_pages: Mapping[Hashable, int] | None = None,
                 default_capacity: int = 1024, salt: bytes = b""):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.salt = salt  # the pool's `prefix_salt(...)`: digests of different models/layouts never meet
        self._capacity = dict(capacity_pages or {})
        self._default = default_capacity
        self._pages: dict[Hashable, OrderedDict[Digest, None]] = {}

    def hashes(self, token_ids: Sequence[int]) -> list[Digest]:
        return page_hashes(token_ids, self.page_size, self.salt)

    def matched_pages(self, worker: Hashable, hashes: Sequence[Digest]) -> int:
        held = self._pages.get(worker)
        if not held:
            return 0
        n = 0
        for d in hashes:  # a chain: the first miss ends the shared prefix
            if d not in held:
                break
            n += 1
        return n

    def matched_tokens(self, worker: Hashable, hashes: Sequence[Digest]) -> int:
        return self.matched_pages(worker, hashes) * self.page_size

    def record(self, worker: Hashable, hashes: Iterable[Digest]) -> None:
        held = self._pages.setdefault(worker, OrderedDict())
        for d in hashes:
            held[d] = None
            held.move_to_end(d)  # used now: last to be evicted
        cap = self._capacity.get(worker, self._default)
        while len(held) > cap:
            held.popitem(last=False)

    def replace(self, worker: Hashable, hashes: Iterable[Digest]) -> None:
        """What the worker says it holds (its prefix cache's `hashes()`), replacing the router's guess."""
        self._pages[worker] = OrderedDict.fromkeys(hashes)

    def forget(self, worker: Hashable) -> None:
        self._pages.pop(worker, None)

    def num_pages(self, worker: Hashable) -> int:
        return len(self._pages.get(worker, ()))


def rank(candidates: Sequence[Hashable], hashes: Sequence[Digest], index: PrefixIndex,
         load: Mapping[Hashable, float], prompt_len: int, cache_weight: float = 1.0,
         max_cached: int | None = None) -> list[Hashable]:
    """Candidates by load + uncached prompt tokens, best first (stable: equals keep the caller's order).
    `max_cached`: the most tokens a hit can cover (prefill: all but the last token, always computed)."""
    top = max(prompt_len - 1, 0) if max_cached is None else max_cached

    def cost(w: Hashable) -> float:
        return load.get(w, 0.0) + prompt_len - cache_weight * min(index.matched_tokens(w, hashes), top)

    return sorted(candidates, key=cost)


def pick(candidates: Sequence[Hashable], hashes: Sequence[Digest], index: PrefixIndex,
         load: Mapping[Hashable, float], prompt_len: int, cache_weight: float = 1.0) -> Hashable:
    """The candidate with the lowest load + uncached prompt tokens (see the module map)."""
    if not candidates:
        raise ValueError("no candidate worker")
    return rank(candidates, hashes, index, load, prompt_len, cache_weight)[0]


def _name(w: Any) -> str:
    return w.handle.name


class PrefixPlacer:
    """The router's prefix-aware placement over router `Worker` records (see the module map)."""

    def __init__(self, infos: Mapping[str, Sequence[tuple[str, dict]]], enabled: bool | None = None,
                 cache_weight: float = 1.0, decode_load_tokens: float = 64.0):
        """`infos`: pool -> [(worker name, its ready() info)]; `enabled`: None = on where workers cache."""
        self.cache_weight, self.decode_load_tokens = cache_weight, decode_load_tokens
        self.index: dict[str, PrefixIndex] = {}
        self.counts = {f"{pool}_{k}": 0 for pool in ("prefill", "decode", "colocated")
                       for k in ("placements", "warm", "claimed_tokens")}
        self.refreshes = 0  # worker reports that replaced the router's guess
        for pool, workers in infos.items():
            px = [(name, (info or {}).get("prefix")) for name, info in workers]
            if enabled is False or not px or any(p is None for _, p in px):
                continue  # (a pool mixing cached and uncached workers is not routed by prefix)
            first = px[0][1]
            self.index[pool] = PrefixIndex(first["page_size"], {n: p["num_pages"] for n, p in px},
                                           salt=bytes.fromhex(first["prefix_salt"]))

    def active(self, pool: str) -> bool:
        return pool in self.index

    def hashes(self, pool: str, prompt: Sequence[int]) -> list[Digest]:
        idx = self.index.get(pool)
        return idx.hashes(prompt) if idx is not None else []

    def decode_order(self, workers: Sequence[Any], hashes: Sequence[Digest], prompt_len: int,
                     need_pages: int) -> list[Any]:
        """Decode workers to try, best first; a worker short of pages for the uncached part is left out
        (its free pages as last reported, less what the router reserved since)."""
        base = sorted(workers, key=lambda w: (-w.free_pages(), len(w.flights)))  # without a cache: most room
        idx = self.index.get("decode")
        if idx is None:
            return [w for w in base if w.stats is None or w.free_pages() >= need_pages]
        ok = [w for w in base if w.stats is None or w.free_pages() >= need_pages - idx.matched_pages(_name(w), hashes)]
        load = {_name(w): len(w.flights) * self.decode_load_tokens for w in ok}
        by_name = {_name(w): w for w in ok}
        return [by_name[n] for n in rank(list(by_name), hashes, idx, load, prompt_len, self.cache_weight,
                                         max_cached=prompt_len)]

    def pick_prefill(self, workers: Sequence[Any], hashes: Sequence[Digest], prompt_len: int) -> tuple[Any, int]:
        """(prefill worker, prompt tokens it is expected to compute): fewest queued + uncached tokens."""
        base = sorted(workers, key=lambda w: (w.queued_tokens, len(w.flights)))
        idx = self.index.get("prefill")
        if idx is None:
            return base[0], prompt_len
        load = {_name(w): float(w.queued_tokens) for w in base}
        by_name = {_name(w): w for w in base}
        best = rank(list(by_name), hashes, idx, load, prompt_len, self.cache_weight)[0]
        cached = min(idx.matched_tokens(best, hashes), max(prompt_len - 1, 0))
        return by_name[best], prompt_len - cached

    def pick_colocated(self, workers: Sequence[Any], hashes: Sequence[Digest], prompt_len: int) -> Any:
        """A colocated replica runs both phases: requests in flight x `decode_load_tokens` + uncached tokens
        (the engine admits by pages itself, so no page filter here)."""
        base = sorted(workers, key=lambda w: (len(w.flights), -w.free_pages()))
        idx = self.index.get("colocated")
        if idx is None:
            return base[0]
        load = {_name(w): len(w.flights) * self.decode_load_tokens for w in base}
        by_name = {_name(w): w for w in base}
        return by_name[rank(list(by_name), hashes, idx, load, prompt_len, self.cache_weight)[0]]

    def record(self, pool: str, worker: Any, hashes: Sequence[Digest]) -> None:
        """`worker` was given this prompt: count the placement, and it will hold these pages from now on."""
        idx = self.index.get(pool)
        if idx is None:
            return
        claimed = idx.matched_tokens(_name(worker), hashes)
        c = self.counts
        c[f"{pool}_placements"] += 1
        c[f"{pool}_warm"] += claimed > 0
        c[f"{pool}_claimed_tokens"] += claimed
        idx.record(_name(worker), hashes)

    def record_output(self, worker: Any, tokens: Sequence[int]) -> None:
        """A request finished on decode/colocated `worker`: prompt + output (`tokens`) have KV there but the
        last token (never computed), so a next turn carrying this answer finds it (multi-turn chat)."""
        idx = self.index.get(worker.pool)
        if idx is not None and len(tokens) > 1:
            idx.record(_name(worker), idx.hashes(tokens[:-1]))

    async def refresh(self, workers: Sequence[Any], flights: Mapping[str, Any], timeout_s: float) -> None:
        """Ask each live caching worker what its cache holds (`prefix_hashes`) and replace the router's guess
        with it (claims of pages it evicted go away; pages it cached on its own appear), then record again the
        prompts of the router's `flights` (its live table, read after the answer) placed there, which it is
        computing or receiving. The one call here that leaves the process; a worker that does not answer
        keeps the old guess (its poller and heartbeat decide about its life)."""
        for w in workers:
            idx = self.index.get(w.pool)
            if idx is None or not w.alive:
                continue
            try:
                hashes = await asyncio.wait_for(w.handle.call("prefix_hashes"), timeout_s)
            except (PdserveError, asyncio.TimeoutError):
                continue
            idx.replace(_name(w), hashes)
            for f in list(flights.values()):
                if w is f.prefill or w is f.decode:
                    idx.record(_name(w), idx.hashes(f.run_prompt))
            self.refreshes += 1

    def forget(self, worker: Any) -> None:
        """A lost (or restarted) worker holds nothing any more."""
        for idx in self.index.values():
            idx.forget(_name(worker))

    def extra(self, workers: Sequence[Any]) -> dict[str, float]:
        """Routing counters and pool totals of the live workers' prefix stats (`BackendStats.extra`)."""
        out = {f"prefix_routing_{k}": float(v) for k, v in self.counts.items()}
        out["prefix_routing_refreshes"] = float(self.refreshes)
        for pool in ("prefill", "decode", "colocated"):
            stats = [w.stats for w in workers if w.pool == pool and hasattr(w.stats, "prefix_queried_tokens")]
            if not stats:
                continue
            q, h = sum(s.prefix_queried_tokens for s in stats), sum(s.prefix_hit_tokens for s in stats)
            out.update({f"{pool}_prefix_queried_tokens": float(q), f"{pool}_prefix_hit_tokens": float(h),
                        f"{pool}_prefix_hit_rate": h / q if q else 0.0})
        senders = [w.stats for w in workers if w.pool == "prefill" and hasattr(w.stats, "kv_bytes_not_sent")]
        if senders:
            out["prefill_tokens_saved"] = float(sum(s.prefill_tokens_saved for s in senders))
            out["kv_bytes_not_sent"] = float(sum(s.kv_bytes_not_sent for s in senders))
            out["kv_tokens_not_sent"] = float(sum(s.kv_tokens_not_sent for s in senders))
        return out
