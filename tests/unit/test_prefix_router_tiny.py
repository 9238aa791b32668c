"""Prefix caching + prefix-aware routing through `ClusterRouter` over real in-process workers (tiny random
Llama, float32, pages of 4, KV over the fake transport; no Ray).

Requests sharing a 30-token prefix at various lengths (a page boundary, one past it, the whole prompt
cached at a boundary, no hit) run concurrently, cache on vs off: greedy-equal to one engine. One at a time
on one decode worker, the KV not sent equals exactly what an engine mirroring the decode worker's cache
holds of each prompt, on both sides' counters and in `BackendStats.extra` (/metrics). With two workers per
pool, a prompt sharing a warm prefix lands where it was cached. Every test ends with nothing held on any
worker, only evictable cache pages, and an empty pool after `reset_prefix_cache()`.
"""
from __future__ import annotations

import asyncio
import random

import pytest

from cluster.http.metrics import FrontendMetrics
from cluster.serving_api import BackendUnavailableError
from cluster.serving.worker_loop import start_local
from engine import SamplingParams
from engine.llm import LLM
from kv_transfer.fake_transport import FakeTransport
from tests.cluster_helpers import TinyCluster, assert_cluster_empty
from tests.cluster_helpers import collect as collect_stream
from tests.exactness import assert_greedy_equal
from tests.unit.leak_checks import assert_allocator_empty

PS = 4
PREFILL_BUDGET = 16  # prefill chunks of 4 pages: a cached prefix ends inside or between chunks
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
rng = random.Random(5)
BASE = [rng.randrange(3, 256) for _ in range(30)]
TAIL = [[rng.randrange(3, 256) for _ in range(n)] for n in (5, 7, 3, 9, 6)]
PROMPTS = [BASE[:8] + TAIL[0], BASE[:9] + TAIL[1], BASE[:16], list(BASE), BASE[:3] + TAIL[2], TAIL[3] + BASE,
           BASE + TAIL[4], BASE[:16] + TAIL[0]]


@pytest.fixture(scope="module")
def reference(tiny_dir):
    alone = LLM(model=str(tiny_dir), dtype="float32", num_pages=128, page_size=PS)
    return [o.token_ids for o in alone.generate([BASE] + PROMPTS, GREEDY)]


class Cluster:
    """A router over in-process workers; keeps the workers so a test can inspect their engines after the
    loops stopped."""

    def __init__(self, tiny_dir, cache=True, n_prefill=1, n_decode=1, routing=None, decode_load_tokens=64.0,
                 fault=None, policy="fail", decode_pages=96, refresh_s=5.0):
        """`routing`: prefix-aware routing (None: where workers cache); `refresh_s`: how often the router
        replaces its prefix index by the workers' reports."""
        transport = FakeTransport(fault)
        shape = TinyCluster(tiny_dir, page_size=PS, decode_pages=decode_pages, prefill_budget=PREFILL_BUDGET,
                            prefix_caching=cache, drain_timeout_s=0.2)
        self.engines: dict[str, LLM] = {}

        def build(name, make):
            def factory():
                w = make()
                self.engines[name] = w.llm
                return w
            return start_local(name.split("-")[0], name, factory)

        pools = {"prefill": [build(f"prefill-{i}", lambda: shape.prefill(transport)) for i in range(n_prefill)],
                 "decode": [build(f"decode-{i}", lambda: shape.decode(transport, policy)) for i in range(n_decode)]}
        self.router = shape.router("disaggregated", pools, prefix_routing=routing,
                                   decode_load_tokens=decode_load_tokens, prefix_refresh_s=refresh_s)

    async def run(self, i, prompt):
        return (await collect_stream(self.router, f"r{i}", prompt, GREEDY, "tiny"))[0]

    async def close(self):
        """Leak check on every worker, shut down, then: only evictable cache pages; a reset empties them."""
        try:
            await assert_cluster_empty(self.router)
        finally:
            await self.router.shutdown()
        for llm in self.engines.values():
            u = llm.kv_usage()
            assert u["pages_in_use"] == 0 and u["reservations"] == 0, u
            assert u.get("cached_pages", 0) == u.get("evictable_pages", 0)
            llm.reset_prefix_cache()
            assert_allocator_empty(llm.allocator)


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("cache", [True, False])
def test_shared_prefixes_concurrently_are_greedy_equal_with_the_cache_on_and_off(tiny_dir, reference, cache):
    async def main():
        c = Cluster(tiny_dir, cache, n_prefill=2, n_decode=2, decode_load_tokens=1.0)
        try:
            warm = await c.run("warm", BASE)
            got = await asyncio.gather(*(c.run(i, p) for i, p in enumerate(PROMPTS)))
            assert_greedy_equal(reference, [warm] + list(got))
            extra = (await c.router.stats()).extra
            if cache:  # prefixes were found cached and KV was left unsent
                assert extra["prefill_tokens_saved"] > 0 and extra["kv_bytes_not_sent"] > 0
                assert extra["prefix_routing_decode_warm"] > 0 and extra["prefix_routing_prefill_warm"] > 0
            else:
                assert extra["kv_bytes_not_sent"] == extra["prefill_tokens_saved"] == 0
                assert extra["prefix_routing_decode_placements"] == 0  # nothing to route by
        finally:
            await c.close()
    run(main())


def test_bytes_not_sent_equal_what_the_decode_worker_held(tiny_dir, reference):
    """One request at a time, one worker per pool: the decode worker's cache is exactly a mirror engine's
    that ran the same requests, so kv_start of each request is the mirror's cached prefix (whole pages)."""
    async def main():
        c = Cluster(tiny_dir, True)
        mirror = LLM(model=str(tiny_dir), dtype="float32", page_size=PS, num_pages=96, enable_prefix_caching=True)
        want_tokens = want_saved = 0
        try:
            got = []
            for i, p in enumerate([BASE] + PROMPTS):
                want_tokens += len(mirror.prefix_cache.lookup(p, len(p) // PS)[0]) * PS
                want_saved += len(mirror.prefix_cache.lookup(p, (len(p) - 1) // PS)[0]) * PS  # prefill: same history
                got.append(await c.run(i, p))
                mirror.generate(p, GREEDY)
            assert_greedy_equal(reference, got)
            assert (want_tokens, want_saved) == (8 + 8 + 16 + 28 + 0 + 0 + 28 + 16, 8 + 8 + 12 + 28 + 0 + 0 + 28 + 16)
            per_token = c.engines["decode-0"].kv_spec.bytes_per_page() // PS
            extra = (await c.router.stats()).extra
            assert extra["kv_tokens_not_sent"] == want_tokens
            assert extra["kv_bytes_not_sent"] == want_tokens * per_token
            assert extra["decode-0.kv_bytes_not_received"] == want_tokens * per_token
            assert extra["prefill_tokens_saved"] == extra["prefill-0.prefill_tokens_saved"] == want_saved
            assert extra["prefill-0.kv_bytes_sent"] == sum(len(p) for p in [BASE] + PROMPTS) * per_token - \
                want_tokens * per_token
            assert 0 < extra["prefill_prefix_hit_rate"] < 1
            m = FrontendMetrics()
            m.refresh(await c.router.stats())
            text = m.render().decode()
            assert f'pdserve_backend_stat{{name="kv_bytes_not_sent"}} {float(want_tokens * per_token)}' in text
            assert 'pdserve_backend_stat{name="prefill_0_prefix_hit_tokens"}' in text
        finally:
            await c.close()
    run(main())


def test_routing_sends_a_shared_prefix_where_it_is_cached(tiny_dir, reference):
    async def main():
        c = Cluster(tiny_dir, True, n_prefill=2, n_decode=2)
        try:
            await c.run("warm", BASE)
            first = {n: s for n, s in (await c.router.worker_stats()).items()}
            warm_p = next(n for n, s in first.items() if n.startswith("prefill") and s.num_steps)
            warm_d = next(n for n, s in first.items() if n.startswith("decode") and s.num_steps)
            got = await c.run(1, BASE + TAIL[4])
            assert_greedy_equal([reference[7]], [got])
            after = await c.router.worker_stats()
            assert after[warm_p].prefill_tokens_saved == 28 and after[warm_d].kv_bytes_not_received > 0
            assert all(after[n].num_steps == first[n].num_steps for n in after if n not in (warm_p, warm_d))
        finally:
            await c.close()
    run(main())


def test_prefix_routing_off_still_shares_on_the_worker_it_lands_on(tiny_dir, reference):
    async def main():
        c = Cluster(tiny_dir, True, routing=False)
        try:
            got = [await c.run(0, BASE), await c.run(1, BASE + TAIL[4])]
            assert_greedy_equal([reference[0], reference[7]], got)
            extra = (await c.router.stats()).extra
            assert extra["prefix_routing_prefill_placements"] == 0 and extra["kv_tokens_not_sent"] == 28
        finally:
            await c.close()
    run(main())


def corrupt_when_shared():
    """A fault corrupting the first chunk of every push into a reservation on shared pages (kv_start > 0)."""
    start = [0]

    def fault(index, frame):
        kind = frame.WhichOneof("kind")
        if kind == "open":
            start[0] = frame.open.kv_start
        elif kind == "chunk" and index == 1 and start[0]:
            frame.chunk.payload = bytes(len(frame.chunk.payload))  # checksum mismatch: DATA_LOSS
        return [frame]
    return fault


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failed_transfer_into_shared_pages_recomputes_or_fails_and_frees_them(tiny_dir, reference, policy):
    async def main():
        c = Cluster(tiny_dir, True, fault=corrupt_when_shared(), policy=policy)
        try:
            assert_greedy_equal([reference[0]], [await c.run(0, BASE)])  # kv_start 0: untouched
            if policy == "recompute":  # the decode worker re-runs it from its prompt, on its cached prefix
                got = await c.run(1, BASE + TAIL[4])
                assert_greedy_equal([reference[7]], [got])
                assert (await c.router.worker_stats())["decode-0"].num_transfer_failures == 1
            else:
                with pytest.raises(BackendUnavailableError, match="transfer failed"):
                    await c.run(1, BASE + TAIL[4])
        finally:
            await c.close()
    run(main())


def test_colocated_replicas_route_a_shared_prefix_to_the_warm_one(tiny_dir, reference):
    async def main():
        shape = TinyCluster(tiny_dir, page_size=PS, prefix_caching=True, drain_timeout_s=0.2)
        pools = {"colocated": [start_local("colocated", f"colocated-{i}", shape.colocated) for i in range(2)]}
        router = shape.router("colocated", pools)
        try:
            got = [(await collect_stream(router, f"r{i}", p, GREEDY, "tiny"))[0]
                   for i, p in enumerate([BASE, BASE + TAIL[4], BASE[:9] + TAIL[1]])]
            assert_greedy_equal([reference[0], reference[7], reference[2]], got)
            stats = await assert_cluster_empty(router)
            warm = [n for n, s in stats.items() if s.num_steps]
            assert len(warm) == 1 and stats[warm[0]].prefix_hit_tokens == 28 + 8  # both followed the first
            assert (await router.stats()).extra["prefix_routing_colocated_warm"] == 2
        finally:
            await router.shutdown()
    run(main())


def test_a_next_chat_turn_finds_the_answer_cached_where_it_was_decoded(tiny_dir):
    async def main():
        c = Cluster(tiny_dir, True, n_decode=2)
        try:
            out = await c.run(0, BASE)  # 30 + 8 tokens; KV of the first 37 on its decode worker: 9 full pages
            turn2 = BASE + out + TAIL[4]
            idx = c.router.prefix.index["decode"]
            warm = max(("decode-0", "decode-1"), key=lambda n: idx.matched_tokens(n, idx.hashes(turn2)))
            assert idx.matched_tokens(warm, idx.hashes(turn2)) == 36  # prompt and answer pages recorded
            await c.run(1, turn2)
            extra = (await c.router.stats()).extra
            assert extra[f"{warm}.kv_bytes_not_received"] == extra["kv_bytes_not_sent"] > 0
            assert extra["kv_tokens_not_sent"] == 36 and extra["prefill-0.prefill_tokens_saved"] == 28
        finally:
            await c.close()
    run(main())


def test_decode_page_pressure_evicts_cached_pages_and_preempts_without_changing_outputs(tiny_dir, reference):
    """16 pages of 4 tokens on the decode worker: the eight requests need ~60 at their longest, so cached
    pages are evicted for reservations (and, depending on timing, running requests preempted and recomputed
    there on their cached prefix)."""
    async def main():
        c = Cluster(tiny_dir, True, decode_pages=16)
        try:
            warm = await c.run("warm", BASE)
            got = await asyncio.gather(*(c.run(i, p) for i, p in enumerate(PROMPTS)))
            assert_greedy_equal(reference, [warm] + list(got))
        finally:
            await c.close()
        st = c.engines["decode-0"].prefix_stats()  # (its loop has stopped: safe to read from here)
        assert st["evicted_pages"] > 0 and st["shared_received_pages"] > 0
    run(main())


def test_the_index_is_refreshed_from_what_the_workers_report(tiny_dir):
    """A claim the router made up (pages a worker never held, or evicted) goes away once the workers report;
    what they do hold (the prompt's pages on the prefill side, prompt + answer on the decode side) stays."""
    async def main():
        c = Cluster(tiny_dir, True, refresh_s=0.1)
        try:
            await c.run(0, BASE)
            idx = c.router.prefix.index
            ghost = idx["decode"].hashes(TAIL[3] * 2)  # 4 pages no worker has
            idx["decode"].record("decode-0", ghost)
            seen = c.router.prefix.refreshes
            for _ in range(200):
                await asyncio.sleep(0.05)
                if c.router.prefix.refreshes >= seen + 4:  # (both workers, twice: the ghost was recorded before)
                    break
            assert idx["decode"].matched_tokens("decode-0", ghost) == 0
            assert idx["prefill"].matched_tokens("prefill-0", idx["prefill"].hashes(BASE)) == 28
            assert idx["decode"].num_pages("decode-0") == 9  # 37 computed tokens of prompt + answer
            assert (await c.router.stats()).extra["prefix_routing_refreshes"] >= seen + 4
        finally:
            await c.close()
    run(main())
