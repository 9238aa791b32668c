"""`cluster.serving.prefix_routing.PrefixPlacer`, the router's prefix-aware choices, on router `Worker` records with
plain stats (pure: no model, no threads): the warm worker wins, load outweighs a small cached prefix, a
decode worker without the pages for the uncached part is never picked, a lost worker is forgotten, a
pool whose workers do not cache (or routing off) keeps the old order, and `extra()` sums the pools."""
from __future__ import annotations

from dataclasses import dataclass

from cluster.serving.prefix_routing import PrefixPlacer
from cluster.serving.recovery import Worker
from decode_worker.worker import DecodeStats
from prefill_worker.worker import PrefillStats

PS = 4
INFO = {"prefix": {"prefix_salt": "ab" * 16, "page_size": PS, "num_pages": 64}}
PROMPT = list(range(40))  # 10 full pages


@dataclass
class Handle:
    name: str
    info: dict


def workers(pool, n, info=INFO, free=64):
    out = [Worker(Handle(f"{pool}-{i}", info), pool) for i in range(n)]
    for w in out:
        w.stats = DecodeStats(free_pages=free) if pool == "decode" else PrefillStats()
    return out


def placer(pre, dec, **kw):
    return PrefixPlacer({"prefill": [(w.handle.name, w.handle.info) for w in pre],
                         "decode": [(w.handle.name, w.handle.info) for w in dec]}, **kw)


def test_the_warm_prefill_worker_wins_until_its_queue_outweighs_the_cached_prefix():
    pre, dec = workers("prefill", 2), workers("decode", 2)
    px = placer(pre, dec)
    h = px.hashes("prefill", PROMPT)
    assert len(h) == 10 and px.pick_prefill(pre, h, 40) == (pre[0], 40)  # cold: the first
    px.record("prefill", pre[1], h[:5])  # prefill-1 holds 20 tokens of the prompt
    assert px.pick_prefill(pre, h, 40) == (pre[1], 20)
    pre[1].queued_tokens = 19  # 19 queued + 20 to compute < 0 + 40
    assert px.pick_prefill(pre, h, 40)[0] is pre[1]
    pre[1].queued_tokens = 21  # now the cold, idle worker finishes first
    assert px.pick_prefill(pre, h, 40) == (pre[0], 40)
    assert px.counts["prefill_placements"] == 1 and px.counts["prefill_warm"] == 0


def test_decode_order_prefers_the_cached_prefix_against_load_and_never_lacks_pages():
    pre, dec = workers("prefill", 1), workers("decode", 2)
    px = placer(pre, dec, decode_load_tokens=16.0)
    h = px.hashes("decode", PROMPT)
    px.record("decode", dec[1], h)  # decode-1 holds the whole prompt: nothing to ship
    assert px.decode_order(dec, h, 40, 10) == [dec[1], dec[0]]
    dec[1].flights = {"a", "b"}  # 2 x 16 load + 0 uncached < 40 uncached on the idle one
    assert px.decode_order(dec, h, 40, 10)[0] is dec[1]
    dec[1].flights = {"a", "b", "c"}  # 48 > 40: load outweighs it
    assert px.decode_order(dec, h, 40, 10) == [dec[0], dec[1]]
    dec[0].stats = DecodeStats(free_pages=9)  # 10 pages needed, none cached there: never picked
    assert px.decode_order(dec, h, 40, 10) == [dec[1]]
    dec[1].stats = DecodeStats(free_pages=0)  # every page cached: it still fits
    assert px.decode_order(dec, h, 40, 10) == [dec[1]]
    px.forget(dec[1])  # lost: it holds nothing now, so it lacks the pages
    assert px.decode_order(dec, h, 40, 10) == []


def test_without_caching_workers_or_with_routing_off_the_old_order_stays():
    for enabled, info in [(False, INFO), (None, {"prefix": None}), (True, {})]:
        pre, dec = workers("prefill", 2, info), workers("decode", 2, info)
        px = placer(pre, dec, enabled=enabled)
        assert not px.active("prefill") and not px.active("decode") and px.hashes("decode", PROMPT) == []
        dec[0].stats, pre[0].queued_tokens = DecodeStats(free_pages=10), 5
        assert px.decode_order(dec, [], 40, 10) == [dec[1], dec[0]]  # most free pages first
        assert px.pick_prefill(pre, [], 40) == (pre[1], 40)  # fewest queued tokens
        px.record("decode", dec[0], [])
        assert px.counts["decode_placements"] == 0


def test_extra_sums_the_pools_prefix_stats():
    pre, dec = workers("prefill", 2), workers("decode", 1)
    pre[0].stats = PrefillStats(prefix_queried_tokens=100, prefix_hit_tokens=40, prefill_tokens_saved=40,
                                kv_tokens_not_sent=8, kv_bytes_not_sent=800)
    pre[1].stats = PrefillStats(prefix_queried_tokens=100, prefix_hit_tokens=10, prefill_tokens_saved=10)
    dec[0].stats = DecodeStats(prefix_queried_tokens=0)
    extra = placer(pre, dec).extra(pre + dec)
    assert extra["prefill_prefix_hit_rate"] == 0.25 and extra["prefill_tokens_saved"] == 50
    assert extra["kv_bytes_not_sent"] == 800 and extra["kv_tokens_not_sent"] == 8
    assert extra["decode_prefix_hit_rate"] == 0.0 and extra["prefix_routing_decode_placements"] == 0
