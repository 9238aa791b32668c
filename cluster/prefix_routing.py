"""KV-aware routing: which worker most likely holds a prompt's prefix, weighed against its load.

Who calls it: `cluster.router` when it places a request (prefill pool: who computes the fewest uncached
tokens; decode pool: who needs the fewest KV bytes shipped). Pure Python, no clock, no I/O.

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
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Iterable, Mapping, Sequence

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


def pick(candidates: Sequence[Hashable], hashes: Sequence[Digest], index: PrefixIndex,
         load: Mapping[Hashable, float], prompt_len: int, cache_weight: float = 1.0) -> Hashable:
    """The candidate with the lowest load + uncached prompt tokens (see the module map)."""
    if not candidates:
        raise ValueError("no candidate worker")

    def cost(w: Hashable) -> float:
        cached = min(index.matched_tokens(w, hashes), max(prompt_len - 1, 0))  # the last token is always computed
        return load.get(w, 0.0) + prompt_len - cache_weight * cached

    return min(candidates, key=cost)  # min keeps the first of equals
