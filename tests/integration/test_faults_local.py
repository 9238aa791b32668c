"""Fault injection against the real local cluster: `deploy/local-2d.yaml` (1 prefill + 2 decode Ray actors,
KV over loopback gRPC, policy recompute) with SmolLM2 in float32 (the file serves bfloat16; greedy-equal
needs float32), Ray actor restarts on (`reliability.actor_max_restarts: 1`). Marker `faults` (and `slow`:
it loads SmolLM2); the README test command runs it.

One cluster serves the whole module (starting it is most of the cost here), on one event loop, in this
order (each test reads the ledger's change, so they run in file order on the shared router):
  1. KV chunk faults aimed at one request each (`FaultyTransport`'s `requests` plan: drop, corrupt,
     duplicate, delay past the push deadline) beside untouched requests;
  2. a client disconnect mid-stream;
  3. a slow decode actor (`WorkerActor.slow_steps`, a test hook): its requests end "timeout" on time;
  4. a burst of 10x the goodput measured first from sequential requests;
  5. the prefill actor killed mid-prefill: no other prefill actor, so its requests wait in the queue while
     Ray restarts it from the same spec; it rejoins and they are re-prefilled there, token-identical;
  6. a decode actor killed mid-stream for good: its requests resume on the other decode actor.
Each checks: ledger admitted == completed + failed + cancelled, completed outputs greedy-equal to one
`engine.LLM` (float32), failures typed and on time, nothing left on any live actor after quiesce, and the
requests the fault did not touch unaffected."""
from __future__ import annotations

import asyncio
import dataclasses
import math
import pathlib
import time

import pytest
import torch
import yaml

from cluster.serving.ray_pools import start_cluster
from cluster.serving_api import GenerateRequest, OverloadedError
from cluster.spec import parse_spec
from engine import LLM, SamplingParams
from kv_transfer.fault_transport import FaultyTransport
from tests.cluster_helpers import assert_cluster_empty
from tests.exactness import assert_greedy_equal
from tests.prompts import token_prompts

pytestmark = [pytest.mark.slow, pytest.mark.faults]
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
LENGTHS = [40, 60, 80, 100, 120, 140]
MODEL = "smollm2-135m"
# A delayed chunk stalls its push past the push deadline. 4 s was too tight on a loaded AVX2-only machine:
# the six concurrent float32 prefills' clean pushes outlasted it too (6 transfer failures, not 3).
PUSH_TIMEOUT_S, DELAY_S = 12.0, 14.0
AIMED = {"drop": "drop", "corrupt": "corrupt", "duplicate": "duplicate", "delay": "delay"}  # request id: fault
SPEC = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "local-2d.yaml"


def local_2d():
    raw = yaml.safe_load(SPEC.read_text())
    raw["dtype"] = "float32"  # greedy-equal needs float32
    for pool in raw["pools"].values():  # KV for what these tests hold at once (float32 pages are 4x bf16's)
        pool["kv"]["num_pages"], pool["max_model_len"] = 128, 1024
    raw["kv_transfer"]["push_timeout_s"] = PUSH_TIMEOUT_S
    # Heartbeats stop while the module's event loop idles between tests: only dead actors count as lost.
    raw["reliability"] = {"actor_max_restarts": 1, "heartbeat_timeout_s": 240.0}
    raw["server"].update(max_queued_requests=16, request_timeout_s=300.0)
    return parse_spec(raw)


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    alone = LLM(model=MODEL, dtype="float32", page_size=16, num_pages=256, keep_logits=True)
    prompts = token_prompts(alone.tokenizer, LENGTHS)
    outs = alone.generate(prompts, PARAMS)
    return prompts, [o.token_ids for o in outs], [torch.stack(o.logits) for o in outs]


@pytest.fixture(scope="module")
def cluster(ray_session, reference):
    """(router, event loop): the module's one cluster, with chunk faults aimed at the `AIMED` request ids."""
    t0 = time.monotonic()
    plan = {"requests": AIMED, "at_chunk": 1, "delay_s": DELAY_S}
    router = start_cluster(local_2d(), transport=FaultyTransport(plan))
    print(f"\nlocal-2d cluster (SmolLM2 float32) up in {time.monotonic() - t0:.1f} s")
    loop = asyncio.new_event_loop()
    yield router, loop
    loop.run_until_complete(router.shutdown())
    loop.close()


class Run:
    """One scenario on the shared router: requests by prompt index, greedy checks, the ledger's change."""

    def __init__(self, router, reference):
        self.router, (self.prompts, self.ref, self.logits) = router, reference
        self.before = dataclasses.replace(router.ledger)

    def gen(self, rid: str, i: int, **kw):
        return self.router.generate(GenerateRequest(rid, self.prompts[i], PARAMS, model=MODEL,
                                                    return_timeline=True, **kw))

    async def tokens(self, rid: str, i: int, **kw) -> list[int]:
        out = [d async for d in self.gen(rid, i, **kw)]
        assert out[-1].finished and sum(d.finished for d in out) == 1 and out[-1].finish_reason == "length"
        assert "".join(d.new_text for d in out) == self.router.tokenizer().decode(
            [t for d in out for t in d.new_token_ids])
        return [t for d in out for t in d.new_token_ids]

    def greedy(self, index: list[int], toks: list[list[int]]) -> None:
        assert_greedy_equal([self.ref[i] for i in index], toks, [self.logits[i] for i in index])

    async def quiesce(self, **expect) -> dict:
        """Nothing held on any live actor; the ledger balanced, its change since the start as expected."""
        stats = await assert_cluster_empty(self.router, timeout_s=30)
        led = self.router.ledger
        delta = {k: getattr(led, k) - getattr(self.before, k) for k in expect}
        assert led.balanced(0) and delta == expect, (delta, led)
        return stats


def failures(stats: dict) -> int:
    return sum(s.num_transfer_failures for n, s in stats.items() if n.startswith("decode"))


def test_chunk_faults_are_recomputed_and_untouched_requests_unaffected(cluster, reference):
    router, loop = cluster
    r = Run(router, reference)

    async def main():
        failed_before = failures(await router.worker_stats())
        rids = list(AIMED) + ["clean-4", "clean-5"]
        t0 = time.monotonic()
        got = await asyncio.gather(*(r.tokens(rid, i) for i, rid in enumerate(rids)))
        took = time.monotonic() - t0
        r.greedy(list(range(len(rids))), list(got))
        stats = await r.quiesce(admitted=6, completed=6, failed=0, cancelled=0)
        failed = failures(stats) - failed_before
        assert failed == 3, failed  # drop, corrupt, delay; a duplicate chunk is accepted once
        print(f"chunk faults {sorted(AIMED)} beside 2 clean requests: {failed} transfers failed and were "
              f"recomputed, all 6 greedy-equal in {took:.1f} s")
    loop.run_until_complete(main())


def test_a_client_disconnect_mid_stream_is_cancelled_and_freed(cluster, reference):
    router, loop = cluster
    r = Run(router, reference)

    async def main():
        leaving = r.gen("leaves", 5)
        assert (await leaving.__anext__()).new_token_ids  # streaming has begun...
        others = [asyncio.ensure_future(r.tokens(f"stays-{i}", i)) for i in range(2)]
        await leaving.aclose()  # ...and the client goes away
        r.greedy([0, 1], list(await asyncio.gather(*others)))
        await r.quiesce(admitted=3, completed=2, cancelled=1, failed=0)
    loop.run_until_complete(main())


def test_a_slow_decode_actor_times_its_requests_out_on_time_and_others_finish(cluster, reference):
    router, loop = cluster
    r = Run(router, reference)
    deadline_s, step_s = 15.0, 1.0  # 24 steps on the slow actor take 24 s; on a normal one a few

    async def one(rid: str, i: int):
        t0 = time.monotonic()
        out = [d async for d in r.gen(rid, i, deadline_s=deadline_s)]
        return out, time.monotonic() - t0

    async def main():
        fast, slow = [w for w in router.workers["decode"] if w.alive]
        await slow.handle.actor.slow_steps.remote(step_s)
        try:
            tasks = [asyncio.ensure_future(one(f"s{i}", i)) for i in range(4)]
            # every request on a decode actor, or already done (a fast one can finish before the last is
            # placed: waiting for all four flights at once spun forever then); bounded, so a stall fails
            placed_by = time.monotonic() + 60.0
            while not all(t.done() or (f is not None and f.decode) for t, f in
                          zip(tasks, map(router.flights.by_request.get, [f"s{i}" for i in range(4)]))):
                assert time.monotonic() < placed_by, "requests not placed on decode actors within 60 s"
                await asyncio.sleep(0.05)  # (a generator opens its request when first iterated)
            on_slow = {f.req.request_id for f in router.flights.by_wid.values() if f.decode is slow}
            got = await asyncio.gather(*tasks)
        finally:
            await slow.handle.actor.slow_steps.remote(0.0)
        assert 0 < len(on_slow) < 4, on_slow  # the router spread them: both kinds are exercised
        done = [(i, out) for i, (out, _) in enumerate(got) if out[-1].finish_reason == "length"]
        late = [(f"s{i}", t) for i, (out, t) in enumerate(got) if out[-1].finish_reason == "timeout"]
        assert {rid for rid, _ in late} == on_slow, (late, on_slow)
        assert all(deadline_s - 0.1 < t < deadline_s + 2.0 for _, t in late), late  # typed and on time
        r.greedy([i for i, _ in done], [[t for d in out for t in d.new_token_ids] for _, out in done])
        await r.quiesce(admitted=4, completed=len(done), failed=len(late), cancelled=0)
        print(f"slow decode actor ({step_s} s/step): {len(late)} requests on it timed out at "
              f"{max(t for _, t in late):.1f} s (deadline {deadline_s} s), {len(done)} elsewhere finished")
    loop.run_until_complete(main())


async def _burst_one(r: Run, rid: str, i: int, delay_s: float, deadline_s: float):
    await asyncio.sleep(delay_s)
    t0 = time.monotonic()
    try:
        out = [d async for d in r.gen(rid, i, deadline_s=deadline_s)]
    except OverloadedError:
        return i, "429", None, time.monotonic() - t0
    return i, out[-1].finish_reason, [t for d in out for t in d.new_token_ids], time.monotonic() - t0


def test_a_burst_of_10x_the_measured_goodput_ends_typed_and_on_time(cluster, reference):
    router, loop = cluster
    r = Run(router, reference)
    window_s = 2.0

    async def main():
        # Goodput, measured: 3 sequential requests give the mean end-to-end latency; each decode replica
        # finishes one request per latency when they arrive one at a time (a floor: batching does more).
        lat = []
        for i in range(3):
            t0 = time.monotonic()
            r.greedy([i], [await r.tokens(f"g{i}", i)])
            lat.append(time.monotonic() - t0)
        replicas = sum(w.alive for w in router.workers["decode"])
        goodput = replicas / (sum(lat) / len(lat))  # requests/s
        n = math.ceil(10 * goodput * window_s)  # 10x that rate for `window_s`, evenly spaced
        deadline_s = 4 * max(lat)  # room for the first arrivals to finish in the growing batch
        t0 = time.monotonic()
        got = await asyncio.gather(*(_burst_one(r, f"b{k}", k % len(LENGTHS), k * window_s / n, deadline_s)
                                     for k in range(n)))
        took = time.monotonic() - t0
        kinds = [k for _, k, _, _ in got]
        assert set(kinds) <= {"length", "timeout", "429"} and "length" in kinds, kinds
        assert all(t < deadline_s + 2.0 for _, k, _, t in got if k == "timeout"), got
        assert all(t < 1.0 for _, k, _, t in got if k == "429"), got  # refused at once, never admitted
        done = [(i, toks) for i, k, toks, _ in got if k == "length"]
        r.greedy([i for i, _ in done], [toks for _, toks in done])
        await r.quiesce(admitted=3 + n - kinds.count("429"), completed=3 + len(done),
                        failed=kinds.count("timeout"), cancelled=0)
        print(f"goodput {goodput:.2f} req/s ({replicas} decode x 1 / mean e2e {sum(lat) / len(lat):.2f} s); "
              f"burst of {n} in {window_s} s (10x): {dict((k, kinds.count(k)) for k in sorted(set(kinds)))}, "
              f"deadline {deadline_s:.1f} s, {len(done) / took:.2f} req/s completed, over in {took:.1f} s")
    loop.run_until_complete(main())


def test_the_prefill_actor_killed_mid_prefill_is_restarted_and_its_requests_resume_on_it(cluster, reference):
    import ray

    router, loop = cluster
    r = Run(router, reference)

    async def main():
        (prefill,) = [w for w in router.workers["prefill"] if w.alive]
        untouched = [asyncio.ensure_future(r.tokens(f"u{i}", i)) for i in (4, 5)]
        ended_by = time.monotonic() + 60.0  # bounded: a stall fails instead of spinning
        while not all(t.done() or (f is not None and f.prefill_ended)
                      for t, f in zip(untouched, map(router.flights.by_request.get, ["u4", "u5"]))):
            assert time.monotonic() < ended_by, "u4, u5 not past prefill within 60 s"
            await asyncio.sleep(0.05)  # their KV has left the prefill actor: the kill must not touch them
        await prefill.handle.actor.slow_steps.remote(2.0)  # the next prefill steps crawl: kill mid-prefill
        victims = [asyncio.ensure_future(r.tokens(f"v{i}", i)) for i in (0, 1)]
        while sum(wid.startswith("v") for wid in prefill.flights) < 2:
            assert time.monotonic() < ended_by + 60.0, "v0, v1 not on the prefill actor within 60 s"
            await asyncio.sleep(0.05)
        t0 = time.monotonic()
        ray.kill(prefill.handle.actor, no_restart=False)  # a crash Ray restarts (max_restarts 1)
        r.greedy([4, 5], list(await asyncio.gather(*untouched)))
        # no other prefill actor: the victims wait in the queue for the restart (AwaitingRestart), then are
        # re-prefilled on the new incarnation, token-identical
        r.greedy([0, 1], list(await asyncio.gather(*victims)))
        done_in = time.monotonic() - t0
        (new,) = [w for w in router.workers["prefill"] if w.alive]
        assert new.handle.info["incarnation"] != prefill.handle.info["incarnation"]
        assert router.ledger.recovered - r.before.recovered >= 2
        r.greedy([2, 3], list(await asyncio.gather(*(r.tokens(f"after-{i}", i) for i in (2, 3)))))
        await r.quiesce(admitted=6, completed=6, failed=0, cancelled=0, workers_lost=1, workers_rejoined=1)
        print(f"prefill actor killed mid-prefill: restarted, rejoined, and its 2 requests completed "
              f"greedy-equal {done_in:.1f} s after the kill; 2 decoding requests untouched")
    loop.run_until_complete(main())


def test_a_decode_actor_killed_mid_stream_resumes_on_the_other(cluster, reference):
    import ray

    router, loop = cluster
    r = Run(router, reference)

    async def main():
        gens = [r.gen(f"r{i}", i) for i in range(len(LENGTHS))]
        outs = [[await g.__anext__()] for g in gens]  # every request has streamed its first token
        victim = max((w for w in router.workers["decode"] if w.alive), key=lambda w: len(w.flights))
        moved = len(victim.flights)
        assert moved > 0
        t0 = time.monotonic()
        ray.kill(victim.handle.actor, no_restart=True)  # dead for good

        async def rest(g, out):
            out += [d async for d in g]
        await asyncio.gather(*(rest(g, o) for g, o in zip(gens, outs)))
        took = time.monotonic() - t0
        toks = [[t for d in out for t in d.new_token_ids] for out in outs]
        for out, t in zip(outs, toks):
            assert out[-1].finished and sum(d.finished for d in out) == 1
            assert "".join(d.new_text for d in out) == router.tokenizer().decode(t)
        r.greedy(list(range(len(LENGTHS))), toks)
        resumed = sum("recovered" in out[-1].timeline for out in outs)
        assert 0 < resumed <= moved and not victim.alive
        n = len(LENGTHS)
        await r.quiesce(admitted=n, completed=n, failed=0, cancelled=0, workers_lost=1)
        print(f"decode actor killed: {resumed} of {n} requests resumed; all done {took:.1f} s later")
    loop.run_until_complete(main())
