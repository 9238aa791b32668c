"""Fault injection on the in-process cluster (tiny random Llama, real workers on `WorkerLoop` threads, the fake
KV transport; no Ray): a prefill worker stopped mid-prefill, a decode worker stopped mid-stream, a worker
whose event stream hangs (heartbeat timeout on an injected clock), one that does not answer a placement
command (call timeout), KV chunks dropped / duplicated / corrupted / delayed past the deadline, a slow
decode worker, a client that disconnects mid-stream (the bounded soak: test_faults_soak.py). Each scenario
checks the ledger (admitted == completed + failed + cancelled, nothing in flight), that completed outputs
are greedy-equal to the fault-free run, that failures are typed, that requests the fault did not touch
ran undisturbed, and that no live worker holds a page, reservation or transfer afterwards."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from cluster.serving_api import BackendUnavailableError, GenerateRequest
from cluster.serving.worker_loop import start_local
from decode_worker.worker import DecodeWorker
from engine import SamplingParams
from kv_transfer.fake_transport import FakeTransport
from prefill_worker.worker import PrefillWorker
from tests.cluster_helpers import TinyCluster, assert_cluster_empty, greedy_reference
from tests.cluster_helpers import collect as collect_stream
from tests.exactness import assert_greedy_equal
from tests.prompts import CLUSTER_PROMPTS

PAGE = 4
LONG = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
PROMPTS = CLUSTER_PROMPTS


@pytest.fixture(scope="module")
def reference(tiny_dir):
    return greedy_reference(tiny_dir, PROMPTS, LONG, PAGE)


class SlowDecode(DecodeWorker):
    """A decode worker whose steps take at least `delay_s` (a slow or overloaded machine)."""
    delay_s = 0.02

    def step(self):
        time.sleep(self.delay_s)
        return super().step()


class SlowPrefill(PrefillWorker):
    delay_s = 0.0

    def step(self):
        time.sleep(self.delay_s)
        return super().step()


class FakeClock:
    def __init__(self):
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


def cluster(tiny_dir, n_prefill=1, n_decode=2, policy="fail", fault=None, prefill_delay=0.0,
            decode_delay=SlowDecode.delay_s, timeout_s=60.0, clock=None, **cfg):
    """A disaggregated tiny cluster whose steps take at least the given delays; `fault`: the fake
    transport's hook, `policy`: the decode side's on a failed transfer, `cfg`: `RouterConfig` fields."""
    shape, transport = TinyCluster(tiny_dir, page_size=PAGE, request_timeout_s=timeout_s), FakeTransport(fault)

    def prefill():
        w = shape.prefill(transport, cls=SlowPrefill)
        w.delay_s = prefill_delay
        return w

    def decode():
        w = shape.decode(transport, policy, cls=SlowDecode)
        w.delay_s = decode_delay
        return w

    pools = {"prefill": [start_local("prefill", f"prefill-{i}", prefill) for i in range(n_prefill)],
             "decode": [start_local("decode", f"decode-{i}", decode) for i in range(n_decode)]}
    return shape.router("disaggregated", pools, clock=clock, **cfg)


async def collect(router, rid, prompt, params=LONG, **kw):
    return await collect_stream(router, rid, prompt, params, "tiny", **kw)


async def quiesce(router, completed=0, failed=0, cancelled=0):
    """Nothing leaked on any live worker; every admitted request ended once, in the expected column."""
    await assert_cluster_empty(router)
    led = router.ledger
    assert led.balanced(0) and (led.completed, led.failed, led.cancelled) == (completed, failed, cancelled), led
    extra = (await router.stats()).extra
    assert extra["requests_admitted"] == led.admitted and extra["requests_in_flight"] == 0


def stop(router, pool, i):
    """Kill worker `i` of `pool`: its loop ends, the worker closes (what it held is gone with it)."""
    return asyncio.to_thread(router.workers[pool][i].handle.loop.stop)


def run(coro):
    asyncio.run(coro)


def streams(router, params=LONG, **kw):
    gens = [router.generate(GenerateRequest(f"r{i}", p, params, model="tiny", return_timeline=True, **kw))
            for i, p in enumerate(PROMPTS)]
    return gens, [[] for _ in gens]


async def drain_all(gens, outs):
    async def rest(gen, out):
        out += [d async for d in gen]
    await asyncio.gather(*(rest(g, o) for g, o in zip(gens, outs)))
    for out in outs:
        assert out[-1].finished and sum(d.finished for d in out) == 1
    return [[t for d in out for t in d.new_token_ids] for out in outs]


def test_a_decode_worker_killed_mid_stream_resumes_its_requests_on_the_other(tiny_dir, reference):
    async def main():
        router = cluster(tiny_dir)
        try:
            gens, outs = streams(router)
            for g, out in zip(gens, outs):  # every request streams a few tokens first
                while sum(len(d.new_token_ids) for d in out) < 3:
                    out.append(await g.__anext__())
            victims = set(router.workers["decode"][0].flights)
            assert victims and len(victims) < len(gens), "placement should spread over both decode workers"
            t0 = time.monotonic()
            await stop(router, "decode", 0)
            toks = await drain_all(gens, outs)
            recovery_s = time.monotonic() - t0
            assert_greedy_equal(reference, toks)  # no token lost, none repeated, same tokens
            for out in outs:
                assert "".join(d.new_text for d in out) == router.tokenizer().decode([t for d in out for t in
                                                                                      d.new_token_ids])
            recovered = [i for i, out in enumerate(outs) if "recovered" in out[-1].timeline]
            assert len(recovered) == len(victims), (recovered, victims)  # the others were never touched
            await quiesce(router, completed=len(gens))
            assert router.ledger.recovered == len(victims) and router.ledger.workers_lost == 1
            print(f"decode worker killed: {len(victims)} requests resumed, all done {recovery_s:.2f} s later")
        finally:
            await router.shutdown()
    run(main())


def test_a_prefill_worker_killed_mid_prefill_is_re_prefilled_on_a_healthy_one(tiny_dir, reference):
    async def main():
        router = cluster(tiny_dir, n_prefill=2, n_decode=1, prefill_delay=0.3)
        try:
            tasks = [asyncio.ensure_future(collect(router, f"r{i}", p)) for i, p in enumerate(PROMPTS)]
            p0 = router.workers["prefill"][0]
            deadline = time.monotonic() + 10
            while not p0.flights:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.005)
            victims = [f for f in router.flights.by_wid.values() if f.prefill is p0 and f.sent_tokens == 0]
            assert victims
            await stop(router, "prefill", 0)
            results = await asyncio.gather(*tasks)
            assert_greedy_equal(reference, [toks for toks, _ in results])
            assert all(f.recoveries == 1 for f in victims)
            await quiesce(router, completed=len(PROMPTS))
        finally:
            await router.shutdown()
    run(main())


def test_without_recoveries_left_a_lost_worker_fails_only_its_requests_typed(tiny_dir, reference):
    async def main():
        router = cluster(tiny_dir, max_recoveries=0)
        try:
            gens, outs = streams(router)
            for g, out in zip(gens, outs):
                out.append(await g.__anext__())
            victims = {f.req.request_id for f in router.flights.by_wid.values() if f.decode is router.workers["decode"][0]}
            await stop(router, "decode", 0)
            for i, (g, out) in enumerate(zip(gens, outs)):
                if f"r{i}" in victims:
                    with pytest.raises(BackendUnavailableError, match="decode-0"):
                        out += [d async for d in g]
                else:
                    out += [d async for d in g]
                    assert_greedy_equal([reference[i]], [[t for d in out for t in d.new_token_ids]])
            await quiesce(router, completed=len(gens) - len(victims), failed=len(victims))
        finally:
            await router.shutdown()
    run(main())


class HangingDrain:
    """Wraps a handle: once `hung`, drain never returns (a partitioned or wedged worker); once `calls_hang`,
    neither do commands other than stats."""

    def __init__(self, inner):
        self.inner, self.name, self.info, self.hung, self.calls_hang = inner, inner.name, inner.info, False, False

    async def call(self, method, *args):
        while self.calls_hang and method != "stats":
            await asyncio.sleep(0.01)
        return await self.inner.call(method, *args)

    async def drain(self, timeout_s):
        while self.hung:
            await asyncio.sleep(0.01)
        return await self.inner.drain(timeout_s)

    async def close(self):
        await self.inner.close()


def test_a_worker_without_heartbeat_is_declared_dead_within_the_bound_and_its_requests_resume(tiny_dir,
                                                                                             reference):
    async def main():
        clock = FakeClock()
        router = cluster(tiny_dir, clock=clock, heartbeat_timeout_s=5.0)
        hang = router.workers["decode"][0].handle = HangingDrain(router.workers["decode"][0].handle)
        try:
            gens, outs = streams(router)
            for g, out in zip(gens, outs):
                out.append(await g.__anext__())
            victims = set(router.workers["decode"][0].flights)
            hang.hung, hung_at = True, clock()
            while router.workers["decode"][0].alive:  # the router's clock runs 5x: healthy workers, whose
                clock.offset += 0.25  # drains return every 0.1 s (0.5 s on this clock), stay fresh
                await asyncio.sleep(0.05)
            detect_s = clock() - hung_at  # (the hung worker's last heartbeat was <= one drain before)
            assert 5.0 - 0.5 <= detect_s <= 5.0 + 1.0, detect_s
            assert all(w.alive for w in router.workers["decode"][1:] + router.workers["prefill"])
            toks = await drain_all(gens, outs)
            assert_greedy_equal(reference, toks)
            assert router.ledger.recovered == len(victims)
            await asyncio.to_thread(hang.inner.loop._thread.join, 10)  # fenced: closed by the router
            assert not hang.inner.loop.alive
            await quiesce(router, completed=len(gens))
            print(f"heartbeat timeout 5 s: declared dead {detect_s:.2f} s (router clock) after it hung")
        finally:
            await router.shutdown()
    run(main())


def test_a_worker_that_does_not_answer_a_placement_command_is_lost_and_others_take_its_requests(tiny_dir,
                                                                                              reference):
    async def main():
        router = cluster(tiny_dir, call_timeout_s=0.5)
        wedged = router.workers["decode"][0].handle = HangingDrain(router.workers["decode"][0].handle)
        wedged.calls_hang = True
        try:
            results = await asyncio.gather(*(collect(router, f"r{i}", p) for i, p in enumerate(PROMPTS)))
            assert_greedy_equal(reference, [toks for toks, _ in results])
            assert not router.workers["decode"][0].alive and router.ledger.workers_lost == 1
            await asyncio.to_thread(wedged.inner.loop._thread.join, 10)  # fenced: closed by the router
            assert not wedged.inner.loop.alive
            await quiesce(router, completed=len(PROMPTS))
        finally:
            await router.shutdown()
    run(main())


class TargetedFault:
    """FakeTransport fault hook acting on the KV of one request (named in each push's Open frame)."""

    def __init__(self, target_prompt, action):
        self.target, self.action, self._local, self.hits = list(target_prompt), action, threading.local(), 0

    def __call__(self, index, frame):
        kind = frame.WhichOneof("kind")
        if kind == "open":
            self._local.mine = list(frame.open.prompt_token_ids) == self.target
        if kind != "chunk" or not getattr(self._local, "mine", False) or frame.chunk.layer != 0:
            return [frame]
        self.hits += 1
        if self.action == "drop":
            return []
        if self.action == "duplicate":
            return [frame, frame]
        if self.action == "corrupt":
            frame.chunk.payload = bytes(len(frame.chunk.payload))
            return [frame]
        if self.hits == 1:
            time.sleep(1.0)  # "delay": past the request's deadline
        return [frame]


@pytest.mark.parametrize("action,policy,expect", [
    ("duplicate", "fail", "completed"),  # duplicates are ignored
    ("drop", "recompute", "completed"),  # the transfer fails; the decode worker recomputes
    ("corrupt", "recompute", "completed"),
    ("drop", "fail", "failed"),  # typed error, only for the request whose KV was hit
    ("corrupt", "fail", "failed"),
    ("delay", "fail", "timeout"),  # past its deadline: ends "timeout" on time
])
def test_kv_chunk_faults_touch_only_their_request(tiny_dir, reference, action, policy, expect):
    async def main():
        fault = TargetedFault(PROMPTS[0], action)
        router = cluster(tiny_dir, policy=policy, fault=fault, decode_delay=0.0)
        try:
            deadline = 0.6 if action == "delay" else None
            first = asyncio.ensure_future(collect(router, "hit", PROMPTS[0], deadline_s=deadline))
            others = await asyncio.gather(*(collect(router, f"r{i}", p) for i, p in enumerate(PROMPTS[1:], 1)))
            assert_greedy_equal(reference[1:], [toks for toks, _ in others])  # untouched requests unaffected
            if expect == "failed":
                with pytest.raises(BackendUnavailableError, match="transfer failed"):
                    await first
            else:
                t0 = time.monotonic()
                toks, deltas = await first
                if expect == "timeout":
                    assert deltas[-1].finish_reason == "timeout" and time.monotonic() - t0 < 1.5
                else:
                    assert_greedy_equal(reference[:1], [toks])
            assert fault.hits >= 1
            n = len(PROMPTS)
            await quiesce(router, completed=n - (expect != "completed"), failed=int(expect != "completed"))
        finally:
            await router.shutdown()
    run(main())


def test_client_disconnect_mid_stream_is_cancelled_and_frees_both_sides(tiny_dir, reference):
    async def main():
        router = cluster(tiny_dir)
        try:
            gens, outs = streams(router)
            outs[0].append(await gens[0].__anext__())
            await gens[0].aclose()  # the client goes away
            toks = await drain_all(gens[1:], outs[1:])
            assert_greedy_equal(reference[1:], toks)
            await quiesce(router, completed=len(gens) - 1, cancelled=1)
        finally:
            await router.shutdown()
    run(main())

