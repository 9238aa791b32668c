"""Self-healing on the in-process cluster (tiny random Llama, real workers on `WorkerLoop` threads, the fake KV
transport, `LocalPools` as the router's spawner; no Ray): a pool's only worker of each role (prefill,
decode, colocated) is killed mid-stream; the requests it held and new ones wait for its replacement (they
neither fail nor burn their recoveries), /health and /metrics say degraded, why and since when, then the
fresh worker joins in the lost one's slot and every request finishes greedy-equal to one `engine.LLM`. A
hung step is caught by the step watchdog (not only by call timeouts) and replaced the same way.
Replacements that fail to start or die at once back off. Each test ends with the ledger balanced and no
live worker holding anything."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from cluster.serving.worker_loop import LocalPools
from cluster.serving_api import GenerateRequest
from engine import SamplingParams
from kv_transfer.fake_transport import FakeTransport
from tests.cluster_helpers import TinyCluster, assert_cluster_empty, greedy_reference, serving
from tests.exactness import assert_greedy_equal
from tests.prompts import CLUSTER_PROMPTS

PAGE = 4
LONG = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = CLUSTER_PROMPTS
LATE = [100, 3, 8, 8]  # a request that arrives while the pool has no worker


@pytest.fixture(scope="module")
def reference(tiny_dir):
    return greedy_reference(tiny_dir, PROMPTS + [LATE], LONG, PAGE)


class Factories:
    """Each pool's worker factory; replacements (every build after the first per pool) first wait for
    `gate` (the test decides when the fresh worker may come up) and may be told to fail. Steps of a
    pool named in `hang` block until `unhang` is set (a hung kernel)."""

    def __init__(self, tiny_dir, mode):
        self.shape = TinyCluster(tiny_dir, page_size=PAGE)
        self.transport, self.mode = FakeTransport(None), mode
        self.gate, self.unhang = threading.Event(), threading.Event()
        self.gate.set()
        self.builds: dict[str, int] = {}
        self.fail_next, self.hang = 0, set()

    def factory(self, pool):
        def build():
            n = self.builds[pool] = self.builds.get(pool, 0) + 1
            if n > 1:
                assert self.gate.wait(60)
                if self.fail_next:
                    self.fail_next -= 1
                    raise RuntimeError("out of memory (injected)")
            worker = self._worker(pool)
            step = worker.step

            def maybe_hung_step():
                if pool in self.hang and n == 1:  # the pool's first worker only: a replacement built before
                    # the test clears `hang` must step normally (else it hangs too, and requests time out)
                    self.unhang.wait()
                return step()
            worker.step = maybe_hung_step
            return worker
        return build

    def _worker(self, pool):
        if pool == "prefill":
            return self.shape.prefill(self.transport)
        if pool == "decode":
            return self.shape.decode(self.transport)
        return self.shape.colocated()


def cluster(tiny_dir, mode="disaggregated", step_timeout_s=None, **cfg):
    """One worker per pool, started (and replaced) by `LocalPools` through `Factories`."""
    f = Factories(tiny_dir, mode)
    names = ("prefill", "decode") if mode == "disaggregated" else ("colocated",)
    spawner = LocalPools({n: f.factory(n) for n in names}, step_timeout_s)
    pools = {n: [spawner.start(n, f"{n}-0")] for n in names}
    return f.shape.router(mode, pools, spawner=spawner, **cfg), f


async def until(cond, timeout_s=30.0):
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        await asyncio.sleep(0.01)


async def start_streams(router, prompts, tokens_first=3):
    gens = [router.generate(GenerateRequest(f"r{i}", p, LONG, model="tiny", return_timeline=True))
            for i, p in enumerate(prompts)]
    outs = [[] for _ in gens]
    for g, out in zip(gens, outs):  # every request streams a few tokens first
        while sum(len(d.new_token_ids) for d in out) < tokens_first:
            out.append(await g.__anext__())
    return gens, outs


async def finish(gens, outs):
    async def rest(gen, out):
        out += [d async for d in gen]
    await asyncio.gather(*(rest(g, o) for g, o in zip(gens, outs)))
    for out in outs:
        assert out[-1].finished and sum(d.finished for d in out) == 1
    return [[t for d in out for t in d.new_token_ids] for out in outs]


async def quiesce(router, completed):
    await assert_cluster_empty(router)
    led = router.ledger
    assert led.balanced(0) and (led.completed, led.failed, led.cancelled) == (completed, 0, 0), led


async def probe(url):
    async with httpx.AsyncClient() as c:
        health = (await c.get(url + "/health")).json()
        metrics = (await c.get(url + "/metrics")).text
    return health, metrics


@pytest.mark.parametrize("mode,victim", [("disaggregated", "prefill"), ("disaggregated", "decode"),
                                         ("colocated", "colocated")])
def test_a_pools_only_worker_killed_mid_stream_is_replaced_and_every_request_finishes(tiny_dir, reference,
                                                                                     mode, victim):
    async def main():
        router, f = cluster(tiny_dir, mode)
        try:
            async with serving(router) as url:
                health, _ = await probe(url)
                assert health["status"] == "ok" and health["pools"][victim]["live"] == 1
                gens, outs = await start_streams(router, PROMPTS)
                f.gate.clear()  # the replacement waits until we have looked at the degraded pool
                killed_at = time.time()
                old = router.workers[victim][0]
                await asyncio.to_thread(old.handle.loop.stop)  # killed: its loop ends, what it held is gone
                await until(lambda: router.ledger.workers_lost == 1)
                late = asyncio.ensure_future(finish(*await_late(router)))  # arrives while the pool is empty
                health, metrics = await probe(url)
                pool = health["pools"][victim]
                assert health["status"] == "degraded" and pool["degraded"] and pool["pending"] == 1
                assert pool["live"] == 0 and pool["target"] == 1 and f"{victim}-0" in pool["reason"]
                assert killed_at - 1 <= pool["since"] <= time.time()
                assert f'pdserve_pool_degraded{{pool="{victim}",reason=' in metrics
                await asyncio.sleep(0.3)  # nothing fails while the pool waits for its replacement
                assert router.ledger.failed == 0 and not late.done()
                f.gate.set()
                toks = await finish(gens, outs)
                assert_greedy_equal(reference[:len(PROMPTS)], toks)
                assert_greedy_equal(reference[len(PROMPTS):], await late)
                (new,) = router.workers[victim]
                assert new is not old and new.alive and new.generation == 1 and old.state == "gone", (router.ledger, f.builds)
                health, metrics = await probe(url)
                assert health["status"] == "ok" and health["pools"][victim]["since"] is None
                assert f'pdserve_pool_degraded{{pool="{victim}",reason=""}} 0.0' in metrics
                assert 'pdserve_backend_stat{name="workers_replaced"} 1.0' in metrics
            await quiesce(router, completed=len(PROMPTS) + 1)
            assert (router.ledger.workers_lost, router.ledger.workers_replaced) == (1, 1)
        finally:
            await router.shutdown()
    asyncio.run(main())


def await_late(router):
    gen = router.generate(GenerateRequest("late", LATE, LONG, model="tiny"))
    return [gen], [[]]


def test_a_hung_step_is_caught_by_the_watchdog_and_the_worker_replaced(tiny_dir, reference):
    async def main():
        router, f = cluster(tiny_dir, step_timeout_s=1.0, call_timeout_s=120.0, heartbeat_timeout_s=120.0)
        try:
            gens, outs = await start_streams(router, PROMPTS)
            old = router.workers["decode"][0]
            t0 = time.monotonic()
            f.hang.add("decode")  # its next step blocks; drains and calls still answer on other threads
            await until(lambda: router.ledger.workers_lost == 1)
            detect_s = time.monotonic() - t0
            f.hang.clear()  # (the replacement steps normally)
            assert "watchdog bound 1.0 s" in old.reason and old.state in ("fenced", "gone"), old.reason
            toks = await finish(gens, outs)
            assert_greedy_equal(reference[:len(PROMPTS)], toks)
            assert router.ledger.workers_replaced == 1 and router.workers["decode"][0].alive
            await quiesce(router, completed=len(PROMPTS))
            print(f"hung decode step: caught {detect_s:.2f} s after it began (bound 1.0 s), replaced, "
                  f"{len(PROMPTS)} requests finished")
        finally:
            f.unhang.set()  # the hung thread may end now
            await router.shutdown()
    asyncio.run(main())


def test_replacements_that_fail_to_start_or_die_at_once_back_off(tiny_dir, reference):
    async def main():
        router, f = cluster(tiny_dir, "colocated", replace_backoff_s=0.05, replace_backoff_max_s=0.1)
        try:
            await router.stats()  # starts the pollers
            f.fail_next = 2  # the next two builds raise (an OOM at load, say)
            await asyncio.to_thread(router.workers["colocated"][0].handle.loop.stop)
            await until(lambda: router.ledger.workers_replaced == 1)
            key = ("colocated", "colocated-0")
            assert f.builds["colocated"] == 4 and router.recovery.crash_loops[key] == 2  # 1 + 2 failed + 1
            first = router.workers["colocated"][0]
            await asyncio.to_thread(first.handle.loop.stop)  # the replacement dies right after joining
            await until(lambda: router.ledger.workers_replaced == 2)
            assert router.recovery.crash_loops[key] == 3  # a quick death counts as one more in the loop
            toks = [t async for d in router.generate(GenerateRequest("after", PROMPTS[0], LONG, model="tiny"))
                    for t in d.new_token_ids]
            assert_greedy_equal(reference[:1], [toks])
            await quiesce(router, completed=1)
            assert router.health()["status"] == "ok"
        finally:
            await router.shutdown()
    asyncio.run(main())


def test_a_replacement_that_lived_idle_past_the_proven_time_is_replaced_at_once(tiny_dir, reference, monkeypatch):
    """A replacement no work reached (the router ranks a fresh worker last until its stats arrive) that is
    killed from outside after `PROVEN_S` is not a crash loop: its slot gets no backoff, however many such
    kills came before. Seen on deploy/local-2d.yaml: kills 12-15 of 20 healed in 20-65 s, the backoff doubling
    each time, because each killed replacement had never stepped."""
    from cluster.serving import recovery

    monkeypatch.setattr(recovery, "PROVEN_S", 0.3, raising=False)

    async def main():
        router, f = cluster(tiny_dir, "colocated", replace_backoff_s=60.0, replace_backoff_max_s=120.0)
        try:
            await router.stats()  # starts the pollers
            key = ("colocated", "colocated-0")
            for n in (1, 2, 3):
                w = router.workers["colocated"][0]
                if n > 1:
                    assert not getattr(w.stats, "num_steps", 0)  # no work reached this replacement
                    await asyncio.sleep(0.4)  # past PROVEN_S
                await asyncio.to_thread(w.handle.loop.stop)
                await until(lambda: router.ledger.workers_replaced == n)  # a 60 s backoff would time this out
                assert router.recovery.crash_loops[key] == 0
            toks = [t async for d in router.generate(GenerateRequest("after", PROMPTS[0], LONG, model="tiny"))
                    for t in d.new_token_ids]
            assert_greedy_equal(reference[:1], [toks])
            await quiesce(router, completed=1)
        finally:
            await router.shutdown()
    asyncio.run(main())
