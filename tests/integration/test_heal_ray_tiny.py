"""Self-healing on a real local Ray with a tiny random Llama (marker `faults`): specs with no reliability keys
at all (the defaults heal). The only actor of each role -- prefill, decode, colocated -- is killed
(`ray.kill`, no restart) mid-stream: the router fences it, `RayPools` starts a fresh actor on the same
placement bundle, the requests the dead one held and one that arrives meanwhile wait for it and finish
greedy-equal to one `engine.LLM`; /health is "ok" again afterwards; the ledger balances; no worker holds
anything. A hung step (`WorkerActor.hang_steps`) is caught by the step watchdog (bound from the spec's
`reliability.step_timeout_s`) and the actor replaced the same way. After each router shuts down, every
CPU the pools reserved is back in Ray (no actor or placement group left over)."""
from __future__ import annotations

import asyncio
import time

import pytest

from cluster.serving.ray_pools import start_cluster
from cluster.serving_api import GenerateRequest
from engine import LLM, SamplingParams
from tests.cluster_helpers import assert_cluster_empty, tiny_ray_spec
from tests.exactness import assert_greedy_equal

pytestmark = pytest.mark.faults
LONG = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
PROMPTS = [[(5 * i + j) % 250 + 3 for j in range(10 + 4 * i)] for i in range(3)] + [[100, 3, 8, 8]]


@pytest.fixture(scope="module")
def reference(tiny_dir):
    alone = LLM(model=str(tiny_dir), dtype="float32", num_pages=64)
    return [o.token_ids for o in alone.generate(PROMPTS, LONG)]


async def _until(cond, what, timeout_s=60.0):
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.05)


async def _heals(router, reference, victim, fault):
    """Stream PROMPTS[:-1], inject `fault` into the only worker of pool `victim` once every stream has
    tokens, add PROMPTS[-1] while it is down; everything finishes greedy-equal on the replacement."""
    gens = [router.generate(GenerateRequest(f"h{i}", p, LONG, model=router.model_name))
            for i, p in enumerate(PROMPTS[:-1])]
    outs = [[await g.__anext__()] for g in gens]
    old = router.workers[victim][0]
    t0 = time.monotonic()
    await fault(old)
    await _until(lambda: router.ledger.workers_lost == 1, "the fault is seen")
    late = router.generate(GenerateRequest("late", PROMPTS[-1], LONG, model=router.model_name))
    gens.append(late)
    outs.append([])

    async def rest(g, out):
        out += [d async for d in g]
    await asyncio.gather(*(rest(g, o) for g, o in zip(gens, outs)))
    assert all(out[-1].finished and sum(d.finished for d in out) == 1 for out in outs)
    assert_greedy_equal(reference, [[t for d in out for t in d.new_token_ids] for out in outs])
    (new,) = router.workers[victim]
    assert new.alive and new.generation == 1 and new.handle.actor is not old.handle.actor
    await _until(lambda: router.health()["status"] == "ok", "healthy again")
    healed = time.monotonic() - t0
    await assert_cluster_empty(router, timeout_s=30)
    led = router.ledger
    assert led.balanced(0) and (led.completed, led.failed) == (len(PROMPTS), 0), led
    assert (led.workers_lost, led.workers_replaced) == (1, 1), led
    return healed


def _resources_back(total):
    import ray

    end = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) < total.get("CPU", 0):
        assert time.monotonic() < end, (ray.available_resources(), total)
        time.sleep(0.2)


@pytest.mark.parametrize("mode,victim", [("disaggregated", "prefill"), ("disaggregated", "decode"),
                                         ("colocated", "colocated")])
def test_a_killed_actor_of_each_role_is_replaced_and_no_request_is_lost(ray_session, tiny_dir, reference,
                                                                       mode, victim):
    import ray

    total = ray.cluster_resources()
    router = start_cluster(tiny_ray_spec(tiny_dir, mode))

    async def kill(w):
        ray.kill(w.handle.actor, no_restart=True)

    async def main():
        try:
            healed = await _heals(router, reference, victim, kill)
            print(f"{victim} actor killed: healthy again {healed:.1f} s later, {len(PROMPTS)} requests done")
        finally:
            await router.shutdown()
    asyncio.run(main())
    _resources_back(total)


def test_a_hung_step_is_caught_by_the_watchdog_and_the_actor_replaced(ray_session, tiny_dir, reference):
    import ray

    total = ray.cluster_resources()
    router = start_cluster(tiny_ray_spec(tiny_dir, reliability={"step_timeout_s": 2.0}))

    async def hang(w):
        await w.handle.actor.hang_steps.remote()

    async def main():
        try:
            healed = await _heals(router, reference, "decode", hang)
            print(f"hung decode step (watchdog bound 2 s): healthy again {healed:.1f} s later")
        finally:
            await router.shutdown()
    asyncio.run(main())
    _resources_back(total)


def _rss() -> int:
    import gc
    import os

    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_twenty_kill_cycles_leave_the_survivors_memory_and_ray_as_they_were(ray_session, tiny_dir, reference):
    """1 prefill + 2 decode actors; 20 times: requests stream, decode-1 is killed mid-stream, every request
    finishes greedy-equal, decode-1's slot heals. The resident memory of the survivors (the prefill actor,
    decode-0 and this process, which runs the router) after cycle 20 is within 5% of cycle 1's."""
    import ray

    total = ray.cluster_resources()
    router = start_cluster(tiny_ray_spec(tiny_dir, pools={"decode": {"replicas": 2}}))

    async def survivors():
        ws = [router.workers["prefill"][0], router.workers["decode"][0]]
        out = {w.name: await w.handle.actor.rss_bytes.remote() for w in ws}
        return {**out, "router": _rss()}

    async def cycle(c):
        gens = [router.generate(GenerateRequest(f"k{c}-{i}", p, LONG, model=router.model_name))
                for i, p in enumerate(PROMPTS)]
        outs = [[await g.__anext__()] for g in gens]
        victim = router.workers["decode"][1]
        ray.kill(victim.handle.actor, no_restart=True)

        async def rest(g, out):
            out += [d async for d in g]
        await asyncio.gather(*(rest(g, o) for g, o in zip(gens, outs)))
        assert_greedy_equal(reference, [[t for d in out for t in d.new_token_ids] for out in outs])
        await _until(lambda: router.health()["status"] == "ok" and router.ledger.workers_replaced == c + 1,
                     f"cycle {c}: healed")
        await assert_cluster_empty(router, timeout_s=30)

    async def main():
        try:
            await cycle(0)
            first = await survivors()
            for c in range(1, 20):
                await cycle(c)
            last = await survivors()
            led = router.ledger
            assert led.balanced(0) and led.failed == 0 and led.completed == 20 * len(PROMPTS), led
            assert (led.workers_lost, led.workers_replaced) == (20, 20), led
            grew = {k: last[k] / first[k] - 1 for k in first}
            print("resident memory, cycle 20 vs cycle 1: " + ", ".join(f"{k} {100 * g:+.1f}%" for k, g in grew.items()))
            assert all(g < 0.05 for g in grew.values()), (first, last)
        finally:
            await router.shutdown()
    asyncio.run(main())
    _resources_back(total)
