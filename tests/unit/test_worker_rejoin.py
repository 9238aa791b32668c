"""A lost worker whose actor is restarted comes back (issue 8: "Ray actors restart per the spec", "an actor
restarted on the same address"), against fake workers (tests/unit/test_router.py's fakes; no Ray, no
model). A restartable handle stands in for `RayHandle`: killing it stops its loop; `reincarnation()` waits
for the "restart" and returns a handle on a fresh fake worker at the SAME address with a new incarnation.
Checked: with `rejoin_restarted` the router takes the new incarnation back as a new record (the old one
stays dead), a request then completes on it, and the old incarnation's reservation id means nothing there;
a fenced (same incarnation) or dead-for-good worker never returns; without the knob nothing is tried."""
from __future__ import annotations

import asyncio
import itertools

from cluster.serving.router import ClusterRouter, RouterConfig
from cluster.serving_api import BackendUnavailableError, GenerateRequest
from cluster.serving.worker_loop import DECODE_METHODS, PREFILL_METHODS, LocalHandle, WorkerLoop
from decode_worker.worker import DecodeDelta
from prefill_worker.worker import PrefillEvent
from tests.unit.test_router import PARAMS, FakeDecode, FakePrefill, Tok, until

_serial = itertools.count()


class Restartable(LocalHandle):
    """A worker 'actor' Ray may restart: same name and address, a new incarnation each start."""

    def __init__(self, name: str, fake, methods, restarts: int = 1, same_incarnation: bool = False):
        super().__init__(name, WorkerLoop(lambda: fake, methods | {"emit"}, name),
                         {"address": f"{name}:7000", "incarnation": f"inc-{next(_serial)}"})
        self.fake, self.methods, self.restarts, self.same = fake, methods, restarts, same_incarnation
        self.restarted = asyncio.Event()
        self.asked = 0

    def kill(self) -> None:
        self.loop.stop()  # its drain now fails: the router loses it

    async def reincarnation(self) -> "Restartable":
        self.asked += 1
        if self.restarts == 0:
            raise BackendUnavailableError(f"worker {self.name} is gone: ActorDiedError")
        await self.restarted.wait()  # Ray holds the call until the restart has built the worker
        nxt = Restartable(self.name, FakeDecode(8) if self.fake.__class__ is FakeDecode else FakePrefill(),
                          self.methods, self.restarts - 1)
        if self.same:
            nxt.info = dict(self.info)
        return nxt


def make(rejoin: bool = True, **handle_kw):
    dec = Restartable("decode-0", FakeDecode(8), DECODE_METHODS, **handle_kw)
    pre_fake = FakePrefill()
    pre = LocalHandle("prefill-0", WorkerLoop(lambda: pre_fake, PREFILL_METHODS | {"emit"}, "prefill-0"),
                      {"address": None})
    pre.fake = pre_fake
    cfg = RouterConfig("disaggregated", "m", 50, 64, 256, max_queued_requests=4, request_timeout_s=5.0,
                       drain_timeout_s=0.02, rejoin_restarted=rejoin)
    return ClusterRouter(cfg, {"decode": [dec], "prefill": [pre]}, Tok(), page_size=4), dec


async def _complete_one(router, rid: str) -> list[int]:
    """Run one request through the live decode worker to its end; its token ids."""
    gen = router.generate(GenerateRequest(rid, [1, 2, 3], PARAMS, model="m"))
    first = asyncio.ensure_future(gen.__anext__())
    dec_w = next(w for w in router.workers["decode"] if w.alive)
    pre_w = router.workers["prefill"][0]
    dec_fake, pre_fake = dec_w.handle.fake, pre_w.handle.fake
    await until(lambda: any(k == "reserve" for k, _ in dec_fake.log))
    wid = [r for k, r in dec_fake.log if k == "reserve"][-1]
    await until(lambda: ("submit", wid) in pre_fake.log)
    await pre_w.handle.call("emit", [PrefillEvent(wid, "first_token", [7], "a", prompt_token_ids=[1, 2, 3])])
    await pre_w.handle.call("emit", [PrefillEvent(wid, "transfer_done")])
    await dec_w.handle.call("emit", [DecodeDelta(wid, [7, 8], "ab", 2, 2, True, "length")])
    pre_fake.held.clear()  # the real workers free what finished themselves
    dec_fake.held.clear()
    out = [await first] + [d async for d in gen]
    return [t for d in out for t in d.new_token_ids]


def test_a_restarted_actor_rejoins_as_a_new_worker_at_the_same_address():
    async def main():
        router, dec = make()
        try:
            assert await _complete_one(router, "before") == [7, 8]
            dec.kill()
            await until(lambda: router.ledger.workers_lost == 1)
            (old,) = router.workers["decode"]
            assert not old.alive and old.state == "fenced"
            dec.restarted.set()  # Ray restarts the actor
            await until(lambda: router.ledger.workers_rejoined == 1)
            (new,) = router.workers["decode"]  # the new incarnation took the old record's slot
            assert old.state == "gone" and not old.alive and new.alive and new.handle.info["address"] == old.handle.info["address"]
            assert new.handle.info["incarnation"] != old.handle.info["incarnation"]
            assert await _complete_one(router, "after") == [7, 8]  # placed on the new incarnation
            # nothing addressed to the old incarnation (its request, cleanups) ever reached the new one
            assert new.handle.fake.log and all(wid.startswith("after#") for _, wid in new.handle.fake.log)
            extra = (await router.stats()).extra
            assert extra["workers_lost"] == 1 and extra["workers_rejoined"] == 1 and router.ledger.balanced(0)
            assert (router.ledger.completed, router.ledger.admitted) == (2, 2)
        finally:
            await router.shutdown()
    asyncio.run(main())


def test_fenced_same_incarnation_or_dead_for_good_never_returns_and_no_knob_no_try():
    async def case(**kw):
        rejoin = kw.pop("rejoin", True)
        router, dec = make(rejoin=rejoin, **kw)
        try:
            await router.stats()  # starts the pollers
            dec.kill()
            await until(lambda: router.ledger.workers_lost == 1)
            dec.restarted.set()
            await asyncio.sleep(0.2)
            assert router.ledger.workers_rejoined == 0 and [w.alive for w in router.workers["decode"]] == [False]
            return dec.asked
        finally:
            await router.shutdown()

    async def main():
        assert await case(same_incarnation=True) == 1  # fenced while hung: the same process stays out
        assert await case(restarts=0) == 1  # out of restarts: ActorDiedError, nothing to wait for
        assert await case(rejoin=False) == 0  # reliability.actor_max_restarts 0: the router does not ask
    asyncio.run(main())


def test_shutdown_does_not_wait_for_a_restart_that_never_comes():
    async def main():
        router, dec = make()
        await router.stats()
        dec.kill()
        await until(lambda: router.ledger.workers_lost == 1)
        await asyncio.wait_for(router.shutdown(), 5)  # the rejoin task waits on `restarted`: cancelled
    asyncio.run(main())


def test_a_request_waits_for_the_restart_of_a_pools_only_worker_or_its_deadline():
    """While the only decode worker is restarting, requests queue (no retries burnt, nothing reserved);
    one completes on the new incarnation, one whose deadline passes first ends "timeout" on time; with
    nothing restarting (out of restarts) a request fails typed at once."""
    async def main():
        router, dec = make()
        try:
            await router.stats()
            dec.kill()
            await until(lambda: router.ledger.workers_lost == 1)
            short = router.generate(GenerateRequest("short", [1, 2, 3], PARAMS, model="m", deadline_s=0.3))
            gen = router.generate(GenerateRequest("waits", [1, 2, 3], PARAMS, model="m"))
            first = asyncio.ensure_future(gen.__anext__())
            out = [d async for d in short]
            assert out[-1].finished and out[-1].finish_reason == "timeout"
            await asyncio.sleep(0.2)
            assert not first.done() and router.ledger.recovered == 0  # queued, not failed
            dec.restarted.set()
            await until(lambda: router.ledger.workers_rejoined == 1)
            new, pre_w = router.workers["decode"][0], router.workers["prefill"][0]
            await until(lambda: any(k == "reserve" for k, _ in new.handle.fake.log))
            wid = [r for k, r in new.handle.fake.log if k == "reserve"][-1]
            await until(lambda: ("submit", wid) in pre_w.handle.fake.log)
            await pre_w.handle.call("emit", [PrefillEvent(wid, "first_token", [7], "a", prompt_token_ids=[1, 2, 3])])
            await pre_w.handle.call("emit", [PrefillEvent(wid, "transfer_done")])
            await new.handle.call("emit", [DecodeDelta(wid, [7, 8], "ab", 2, 2, True, "length")])
            pre_w.handle.fake.held.clear()
            new.handle.fake.held.clear()
            toks = [t for d in [await first] + [d async for d in gen] for t in d.new_token_ids]
            assert toks == [7, 8] and (router.ledger.completed, router.ledger.failed) == (1, 1)
        finally:
            await router.shutdown()

    async def gone():
        router, dec = make(restarts=0)
        try:
            await router.stats()
            dec.kill()
            await until(lambda: router.ledger.workers_lost == 1)
            await until(lambda: dec.asked == 1)
            await asyncio.sleep(0.05)
            gen = router.generate(GenerateRequest("late", [1, 2, 3], PARAMS, model="m"))
            try:
                async for _ in gen:
                    pass
                raise AssertionError("expected a typed error")
            except BackendUnavailableError as e:
                assert "no live decode worker" in str(e)
        finally:
            await router.shutdown()

    asyncio.run(main())
    asyncio.run(gone())
