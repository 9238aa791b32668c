"""Faults on a real local Ray with a tiny random Llama (no SmolLM2; marker `faults`, run by `make test`).

KV chunk faults (issue 8: drop, corrupt, duplicate and delay past the push deadline a KV chunk): the
prefill actor's pushes go through `kv_transfer.fault_transport.FaultyTransport` (a seeded plan) over real
gRPC; under `failure_policy: recompute` every request still completes greedy-equal to one `engine.LLM`,
failed transfers are counted on the decode actor, the ledger balances and the cluster ends empty.

A prefill actor killed before its KV has left (its pushes stalled by the same transport's `delay` fault):
the requests it owed are re-prefilled on the other prefill actor and finish greedy-equal, with no token
lost or repeated in their streams.

A burst of 10x what the queue admits, with deadlines too short to meet in it: the surplus is refused at
once with a typed 429 (`OverloadedError`, never admitted), requests past their deadline end "timeout"
on time, the rest finish greedy-equal, and nothing is left behind. (The burst of 10x the measured goodput
runs on SmolLM2: test_faults_local.py.)

Memory under a repeated fault on Ray: 50 cycles of a corrupted chunk (recomputed), a clean request, a
client leaving mid-stream and a request past its deadline; every actor's resident memory (`WorkerActor.
rss_bytes`, after a full collection) grows < 5% from cycle 10 to cycle 50, and each cycle ends empty.

An actor restarted by Ray rejoins the router ("Ray actors restart per the spec", "an actor restarted on
the same address"): the spec's
`reliability.actor_max_restarts: 1` reaches the actor options; `ray.kill(..., no_restart=False)` kills the
decode actor, Ray restarts it, the router loses the old incarnation and takes the new one back as a new
worker record; requests then run on it greedy-equal to one `engine.LLM` while a client disconnects
mid-stream (its request is cancelled and freed on both actors); the ledger balances and the cluster ends
empty."""
from __future__ import annotations

import asyncio
import time

import pytest

from cluster.serving.ray_pools import start_cluster
from cluster.serving_api import GenerateRequest
from engine import LLM, SamplingParams
from kv_transfer.fault_transport import FAULTS, FaultyTransport
from tests.cluster_helpers import assert_cluster_empty, tiny_ray_spec
from tests.exactness import assert_greedy_equal
from tests.prompts import MIXED

pytestmark = pytest.mark.faults
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = MIXED
LONG = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)  # still streaming when it matters


def spec_for(model_dir, **sections):
    sections = {"server": {"request_timeout_s": 120.0},
                "reliability": {"actor_max_restarts": 1, "heartbeat_timeout_s": 60.0}, **sections}
    return tiny_ray_spec(model_dir, **sections)


def test_kv_chunk_faults_over_grpc_are_recomputed_and_outputs_unchanged(ray_session, tiny_dir):
    prompts = [[(7 * i + j) % 250 + 3 for j in range(12 + 3 * i)] for i in range(12)]
    alone = LLM(model=str(tiny_dir), dtype="float32", num_pages=64)
    ref = [alone.generate([p], PARAMS)[0].token_ids for p in prompts]
    plan = {"seed": 8, "drop": 0.05, "corrupt": 0.05, "duplicate": 0.05, "delay": 0.05, "delay_s": 1.5}
    replica = FaultyTransport(plan)  # the draws the prefill actor's copy makes: one per chunk (2 layers each)
    picks = [replica._pick() for _ in range(2 * len(prompts))]
    assert all(replica.injected[k] for k in FAULTS), replica.injected  # the seed exercises every fault
    spec = spec_for(tiny_dir, kv_transfer={"failure_policy": "recompute", "push_timeout_s": 1.0})
    router = start_cluster(spec, transport=FaultyTransport(plan))

    async def one(i):
        req = GenerateRequest(f"f{i}", prompts[i], PARAMS, model=router.model_name)
        return [t for d in [d async for d in router.generate(req)] for t in d.new_token_ids]

    async def main():
        try:
            got = await asyncio.gather(*(one(i) for i in range(len(prompts))))
            assert_greedy_equal(ref, list(got))
            stats = await assert_cluster_empty(router, timeout_s=30)
            failed = stats["decode-0"].num_transfer_failures
            assert 0 < failed <= sum(k in ("drop", "corrupt", "delay") for k in picks), (failed, picks)
            led = router.ledger
            assert led.balanced(0) and (led.completed, led.failed) == (len(prompts), 0), led
            print(f"chunk faults over gRPC ({dict(replica.injected)} injected): {failed} of {len(prompts)} "
                  f"transfers failed and were recomputed")
        finally:
            await router.shutdown()
    asyncio.run(main())


async def _tokens(router, rid: str) -> list[int]:
    out = [d async for d in router.generate(GenerateRequest(rid, PROMPT, PARAMS, model=router.model_name))]
    assert out[-1].finished and out[-1].finish_reason == "length"
    return [t for d in out for t in d.new_token_ids]


def test_a_prefill_actor_killed_before_its_kv_left_is_re_prefilled_elsewhere(ray_session, tiny_dir):
    import ray

    prompts = [[(5 * i + j) % 250 + 3 for j in range(10 + 4 * i)] for i in range(4)]
    alone = LLM(model=str(tiny_dir), dtype="float32", num_pages=64)
    ref = [alone.generate([p], PARAMS)[0].token_ids for p in prompts]
    spec = tiny_ray_spec(tiny_dir, pools={"prefill": {"replicas": 2}}, server={"request_timeout_s": 120.0},
                         kv_transfer={"push_timeout_s": 60.0})
    stall = FaultyTransport({"delay": 1.0, "delay_s": 0.5})  # every chunk waits: the KV leaves slowly
    router = start_cluster(spec, transport=stall)

    async def main():
        try:
            gens = [router.generate(GenerateRequest(f"p{i}", p, PARAMS, model=router.model_name))
                    for i, p in enumerate(prompts)]
            outs = [[await g.__anext__()] for g in gens]  # every prompt is prefilled: first tokens are out
            victim = max(router.workers["prefill"], key=lambda w: len(w.flights))
            owed = len(victim.flights)
            assert owed > 0
            ray.kill(victim.handle.actor, no_restart=True)  # its pushes are still stalled mid-way

            async def rest(g, out):
                out += [d async for d in g]
            await asyncio.gather(*(rest(g, o) for g, o in zip(gens, outs)))
            toks = [[t for d in out for t in d.new_token_ids] for out in outs]
            assert all(out[-1].finished and sum(d.finished for d in out) == 1 for out in outs)
            assert_greedy_equal(ref, toks)
            await assert_cluster_empty(router, timeout_s=30)
            led = router.ledger
            assert led.balanced(0) and led.completed == len(prompts) and led.workers_lost == 1, led
            assert 0 < led.recovered, led
            print(f"prefill actor killed with {owed} transfers in flight: {led.recovered} re-prefilled elsewhere")
        finally:
            await router.shutdown()
    asyncio.run(main())


def test_a_burst_of_10x_the_queue_and_short_deadlines_end_typed_and_on_time(ray_session, tiny_dir):
    from cluster.serving_api import OverloadedError

    queue = 4
    spec = spec_for(tiny_dir, server={"request_timeout_s": 120.0, "max_queued_requests": queue})
    ref = LLM(model=str(tiny_dir), dtype="float32", num_pages=64).generate([PROMPT], PARAMS)[0].token_ids
    router = start_cluster(spec, transport=FaultyTransport({"delay": 1.0, "delay_s": 0.2}))

    async def one(i):
        late = i % 5 == 0  # a deadline no request can meet while the KV trickles in
        req = GenerateRequest(f"b{i}", PROMPT, PARAMS, model=router.model_name, deadline_s=0.3 if late else None)
        t0 = time.monotonic()
        try:
            out = [d async for d in router.generate(req)]
        except OverloadedError:
            return "429", time.monotonic() - t0
        toks = [t for d in out for t in d.new_token_ids]
        if out[-1].finish_reason == "length":
            assert_greedy_equal([ref], [toks])
        return out[-1].finish_reason, time.monotonic() - t0

    async def main():
        try:
            got = await asyncio.gather(*(one(i) for i in range(10 * queue)))
            kinds = [k for k, _ in got]
            assert kinds.count("429") >= 10 * queue - 2 * queue and "length" in kinds, kinds
            assert all(t < 5.0 for k, t in got if k in ("429", "timeout")), got  # typed and on time
            await assert_cluster_empty(router, timeout_s=30)
            led = router.ledger
            assert led.balanced(0) and led.admitted == len(got) - kinds.count("429"), led
            assert (led.completed, led.failed) == (kinds.count("length"), kinds.count("timeout")), (led, kinds)
            print(f"burst of {len(got)} at a queue of {queue}: {dict((k, kinds.count(k)) for k in set(kinds))}")
        finally:
            await router.shutdown()
    asyncio.run(main())


def test_a_killed_decode_actor_is_restarted_and_rejoins(ray_session, tiny_dir):
    import ray

    ref = LLM(model=str(tiny_dir), dtype="float32", num_pages=64).generate([PROMPT], PARAMS)[0].token_ids
    router = start_cluster(spec_for(tiny_dir))

    async def main():
        try:
            assert_greedy_equal([ref], [await _tokens(router, "before")])
            old = router.workers["decode"][0]
            t0 = time.monotonic()
            ray.kill(old.handle.actor, no_restart=False)  # a crash Ray may restart (max_restarts 1)
            while router.ledger.workers_rejoined < 1:
                assert time.monotonic() - t0 < 120, f"no rejoin: {router.ledger}"
                await router.stats()  # (starts the pollers if nothing did yet)
                await asyncio.sleep(0.1)
            took = time.monotonic() - t0
            old_rec, (new,) = old, router.workers["decode"]  # the new incarnation took the old one's slot
            assert not old_rec.alive and new.alive and router.ledger.workers_lost == 1
            assert new.handle.info["incarnation"] != old_rec.handle.info["incarnation"]
            assert_greedy_equal([ref], [await _tokens(router, "after")])
            leaving = router.generate(GenerateRequest("leaves", PROMPT, PARAMS, model=router.model_name))
            assert (await leaving.__anext__()).new_token_ids  # streaming has begun...
            others = [asyncio.ensure_future(_tokens(router, f"with-{i}")) for i in range(2)]
            await leaving.aclose()  # ...and the client goes away
            assert_greedy_equal([ref, ref], list(await asyncio.gather(*others)))
            await assert_cluster_empty(router, timeout_s=30)
            led = router.ledger
            assert led.balanced(0) and (led.completed, led.cancelled, led.failed) == (4, 1, 0), led
            same = new.handle.info["address"] == old_rec.handle.info["address"]
            print(f"decode actor restarted and rejoined {took:.1f} s after the kill "
                  f"(KV address {'unchanged' if same else 'changed'})")
        finally:
            await router.shutdown()
    asyncio.run(main())


async def _memory_cycle(router, c: int) -> None:
    """One cycle of the repeated fault: a corrupted chunk (recomputed), a clean request, a client that
    leaves mid-stream, a request past its deadline; then nothing may be left anywhere."""
    async def leaves():
        gen = router.generate(GenerateRequest(f"m{c}-leaves", PROMPT, LONG, model=router.model_name))
        await gen.__anext__()
        await gen.aclose()

    async def late():
        req = GenerateRequest(f"m{c}-late", PROMPT, LONG, model=router.model_name, deadline_s=0.05)
        return [d async for d in router.generate(req)][-1].finish_reason

    got = await asyncio.gather(_tokens(router, f"m{c}-bad"), _tokens(router, f"m{c}-ok"), leaves(), late())
    assert got[0] == got[1] and got[3] == "timeout", got
    await assert_cluster_empty(router, timeout_s=30)


def test_actor_memory_is_flat_from_cycle_10_to_50_of_a_repeated_fault(ray_session, tiny_dir):
    cycles, at = 50, 10
    ref = LLM(model=str(tiny_dir), dtype="float32", num_pages=64).generate([PROMPT], PARAMS)[0].token_ids
    plan = {"requests": {f"m{c}-bad": "corrupt" for c in range(cycles)}}  # every cycle's "bad" request
    router = start_cluster(spec_for(tiny_dir, kv_transfer={"failure_policy": "recompute"}),
                                     transport=FaultyTransport(plan))

    async def rss() -> dict[str, int]:
        return {w.handle.name: await w.handle.actor.rss_bytes.remote() for ws in router.workers.values()
                for w in ws}

    async def main():
        try:
            t0, samples = time.monotonic(), []
            assert_greedy_equal([ref], [await _tokens(router, "warm")])
            for c in range(cycles):
                await _memory_cycle(router, c)
                if c + 1 in (at, cycles):
                    samples.append(await rss())
            took = time.monotonic() - t0
            (m10, m50), stats = samples, await router.worker_stats()
            growth = {n: m50[n] / m10[n] - 1 for n in m10}
            print(f"repeated fault x {cycles} on Ray ({took:.1f} s): actor RSS cycle {at} -> {cycles}: " + ", ".join(
                f"{n} {m10[n] / 2**20:.0f} -> {m50[n] / 2**20:.0f} MiB ({100 * g:+.2f}%)" for n, g in growth.items()))
            assert all(g < 0.05 for g in growth.values()), growth
            assert stats["decode-0"].num_transfer_failures == cycles  # each corrupted push failed, recomputed
            led = router.ledger
            assert led.balanced(0) and led.admitted == 1 + 4 * cycles, led
            assert (led.completed, led.cancelled, led.failed) == (1 + 2 * cycles, cycles, cycles), led
        finally:
            await router.shutdown()
    asyncio.run(main())
