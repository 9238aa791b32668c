"""Admission beside the prefill submit (`cluster/serving/admission.py`) and the held finish (`ClusterRouter._hold_finish`),
against the fake workers of test_router.py (pure Python: no model, no transport, no Ray).

A prefill worker answers `submit` between its steps, so a fake whose `submit` blocks stands for a busy one:
while it blocks, later requests are still reserved and submitted elsewhere (admission does not serialise),
an abort ends the request at once and the prefill side is cancelled when the submit answers, and shutdown
cancels the in-flight submit. A submit that fails ends only its own request, with its typed error, and frees
its decode pages. A decode side that finishes before the prefill worker's last report holds the finish for
that report (the timeline is complete), or until the prefill worker is lost (never re-placed: the KV is in).
Pushes into one decode worker wait for one of its `kv_streams_per_decode` receive streams.
Every test ends with nothing held by any fake and nothing left in the router."""
from __future__ import annotations

import asyncio
import threading

import pytest

from cluster.serving_api import BackendUnavailableError
from decode_worker.worker import DecodeDelta
from engine.errors import ReservationError
from prefill_worker.worker import PrefillEvent
from tests.unit.test_router import FakePrefill, settled, start, until, wid_of
from tests.unit.test_router import make_router as router_of


class GatedPrefill(FakePrefill):
    """Its `submit` of the requests named in `stall` waits for `gate` (the worker is mid-step); of those in
    `fail`, raises that error (after `add_request`: the real worker would have queued the prompt)."""

    def __init__(self, stall=(), fail=None):
        super().__init__()
        self.gate, self.stall, self.fail = threading.Event(), set(stall), dict(fail or {})

    def submit(self, rid, prompt, params, desc, address):
        if rid.split("#")[0] in self.stall:
            assert self.gate.wait(10), "the test never opened the gate"
        super().submit(rid, prompt, params, desc, address)
        if (err := self.fail.get(rid.split("#")[0])) is not None:
            raise err


def make_router(prefills, decode_pages=(16,), **cfg):
    return router_of(decode_pages, prefills, **{"max_queued_requests": 8, "request_timeout_s": 10.0, **cfg})


def run(main):
    asyncio.run(main())


async def ready(router):
    """Every worker's stats are in (placement by free pages and queued tokens reads them)."""
    await router.stats()
    await until(lambda: all(w.stats is not None for ws in router.workers.values() for w in ws))


def placed(router, rid) -> bool:
    """`rid` is reserved and its submit is on its way (the prefill worker is chosen)."""
    f = router.flights.by_request.get(rid)
    return f is not None and f.prefill is not None


def submits(fake):
    return [rid for kind, rid in fake.log if kind == "submit"]


def test_a_blocked_submit_does_not_hold_later_requests():
    async def main():
        slow, other = GatedPrefill(stall={"a"}), GatedPrefill()
        router, fakes = make_router([slow, other])
        dec = fakes["decode"][0]
        try:
            await ready(router)
            ga, fa = start(router, "a")
            await until(lambda: placed(router, "a"))  # a's submit now waits in `slow`
            gb, fb = start(router, "b", prompt=(1, 2))
            gc, fc = start(router, "c")  # (fewest queued prefill tokens: `other` for b, 2 < 5 for c too)
            await until(lambda: len(submits(other)) == 2)  # served while a's submit still blocks
            assert not slow.log and not slow.gate.is_set()
            assert [k for k, _ in dec.log] == ["reserve"] * 3
            for rid in "bc":
                assert {"reserved", "prefill_submitted"} <= set(router.flights.by_request[rid].timeline)
                assert router.flights.by_request[rid].prefill_open  # its submit answered: the prefill side is open
            assert not router.flights.by_request["a"].prefill_open
            slow.gate.set()
            await until(lambda: router.flights.by_request["a"].prefill_open)
            for rid, first in (("a", fa), ("b", fb), ("c", fc)):
                await router.abort(rid)
                assert (await first).finish_reason == "abort"
            await settled(router, fakes)
            assert router.ledger.balanced(0) and router.ledger.cancelled == 3
        finally:
            slow.gate.set()
            await router.shutdown()
    run(main)


@pytest.mark.parametrize("err, typed, match", [
    (ReservationError("reservation res-x expired"), ReservationError, "expired"),
    (RuntimeError("bug in submit"), BackendUnavailableError, "placing bad: RuntimeError: bug in submit"),
])
def test_a_failing_submit_fails_its_request_typed_and_frees_its_pages(err, typed, match):
    async def main():
        pre = GatedPrefill(fail={"bad": err})
        router, fakes = make_router([pre])
        dec = fakes["decode"][0]
        try:
            await ready(router)
            gg, fg = start(router, "good")
            gb, fb = start(router, "bad")
            with pytest.raises(typed, match=match):  # (an untyped bug still reaches the client as a typed 503)
                await fb
            wid = wid_of(dec, n=1)
            await until(lambda: ("abort", wid) in dec.log and ("cancel", wid) in pre.log)
            assert wid not in dec.held and wid not in pre.held  # its pages and prompt are free
            good = wid_of(dec)
            assert good in dec.held and ("abort", good) not in dec.log  # the other request is untouched
            await router.workers["prefill"][0].handle.call("emit", [PrefillEvent(good, "first_token", [7], "a")])
            assert (await fg).new_token_ids == [7]
            pre.held.clear()  # (the real workers free a sent prefill and a finished request themselves)
            await router.workers["prefill"][0].handle.call("emit", [PrefillEvent(good, "transfer_done")])
            await router.workers["decode"][0].handle.call("emit", [DecodeDelta(good, [7, 8], "ab", 2, 2, True,
                                                                               "length")])
            dec.held.pop(good)
            assert [d.finish_reason async for d in gg][-1] == "length"
            await settled(router, fakes)
            assert (router.ledger.completed, router.ledger.failed) == (1, 1) and router.ledger.balanced(0)
            await until(lambda: not router.tasks.spawned)  # every task beside the loop has ended
        finally:
            await router.shutdown()
    run(main)


def test_abort_and_disconnect_while_the_submit_is_in_flight():
    async def main():
        pre = GatedPrefill(stall={"a", "b"})
        router, fakes = make_router([pre])
        dec = fakes["decode"][0]
        try:
            await ready(router)
            ga, fa = start(router, "a")
            await until(lambda: placed(router, "a"))
            await router.abort("a")
            assert (await fa).finish_reason == "abort"  # at once: the submit still blocks
            wa = wid_of(dec)
            await until(lambda: ("abort", wa) in dec.log)  # the decode reservation is freed now
            gb, fb = start(router, "b")
            await until(lambda: len(dec.log) == 3)  # b reserved (behind a's blocked submit)
            fb.cancel()  # b's client goes away
            with pytest.raises(asyncio.CancelledError):
                await fb
            await gb.aclose()
            wb = wid_of(dec, n=1)
            await until(lambda: ("abort", wb) in dec.log)
            assert ("cancel", wa) not in pre.log
            pre.gate.set()  # the submits answer: what the prefill worker took is cancelled
            await until(lambda: ("cancel", wa) in pre.log and ("cancel", wb) in pre.log)
            await settled(router, fakes)
            assert router.ledger.cancelled == 2 and router.ledger.balanced(0)
        finally:
            pre.gate.set()
            await router.shutdown()
    run(main)


def test_shutdown_cancels_an_in_flight_submit():
    async def main():
        pre = GatedPrefill(stall={"a"})
        router, _ = make_router([pre], call_timeout_s=60.0)
        await ready(router)
        ga, fa = start(router, "a")
        await until(lambda: placed(router, "a") and router.tasks.spawned)
        submit = next(iter(router.tasks.spawned))
        asyncio.get_running_loop().call_later(0.3, pre.gate.set)  # (closing the worker joins its thread)
        await asyncio.wait_for(router.shutdown(), 10)
        assert submit.cancelled()
        with pytest.raises(BackendUnavailableError, match="shutting down"):
            await fa
        assert not router.tasks.spawned  # (and the request's own end, after shutdown, spawns nothing)
    run(main)


def test_a_finish_before_the_prefill_report_waits_for_it_or_for_the_workers_loss():
    async def main():
        pre = GatedPrefill()
        router, fakes = make_router([pre])
        dec = fakes["decode"][0]
        p, d = router.workers["prefill"][0].handle, router.workers["decode"][0].handle
        try:
            await ready(router)
            gen, first = start(router, "r", return_timeline=True)
            await until(lambda: ("submit", wid_of(dec)) in pre.log)
            wid = wid_of(dec)
            await p.call("emit", [PrefillEvent(wid, "first_token", [7], "a", times={"prefill_end": 1.0})])
            assert (await first).new_token_ids == [7]
            dec.held.pop(wid)
            await d.call("emit", [DecodeDelta(wid, [7, 8, 9], "abc", 3, 3, True, "length")])
            held = await gen.__anext__()  # the tokens stream at once; the finish waits for the report
            assert (held.new_token_ids, held.new_text, held.finished) == ([8, 9], "bc", False)
            nothing = asyncio.ensure_future(gen.__anext__())
            await asyncio.sleep(0.2)
            assert not nothing.done()
            pre.held.clear()
            await p.call("emit", [PrefillEvent(wid, "transfer_done", times={"transfer_done": 2.0})])
            last = await nothing
            assert (last.new_token_ids, last.finished, last.finish_reason) == ([], True, "length")
            assert last.timeline["prefill_end"] < last.timeline["transfer_done"] < last.timeline["finish"]
            assert last.completion_tokens == 3 and ("cancel", wid) not in pre.log

            gen, first = start(router, "s", return_timeline=True)  # again; now the prefill worker dies
            await until(lambda: len(submits(pre)) == 2)
            wid = wid_of(dec, n=1)
            dec.held.pop(wid)
            await d.call("emit", [DecodeDelta(wid, [5], "e", 1, 1, True, "length")])
            assert (await first).new_token_ids == [5]
            pre.held.clear()
            router.workers["prefill"][0].handle.loop.stop()  # its loop ends: drain raises, it is lost
            last = await asyncio.wait_for(gen.__anext__(), 5)
            assert (last.finished, last.finish_reason) == (True, "length") and "transfer_done" not in last.timeline
            assert router.ledger.recovered == 0 and router.ledger.workers_lost == 1  # the KV was in: not re-run
            await settled(router, fakes)
            assert router.ledger.completed == 2 and router.ledger.balanced(0)
        finally:
            await router.shutdown()
    run(main)


def test_pushes_into_one_decode_worker_wait_for_a_free_stream():
    """A decode worker's gRPC server takes `kv_streams_per_decode` pushes at once and refuses more (a burst
    of spawned submits would open one push each): a submit waits for a stream, which its transfer's end
    or its flight's cancel frees."""
    async def main():
        pre = GatedPrefill()
        router, fakes = make_router([pre], kv_streams_per_decode=1)
        dec, p = fakes["decode"][0], router.workers["prefill"][0].handle
        try:
            await ready(router)
            (ga, fa), (gb, fb), (gc, fc) = (start(router, rid) for rid in "abc")
            await until(lambda: len(dec.log) == 3 and len(submits(pre)) == 1)  # all reserved, one push open
            await asyncio.sleep(0.1)
            assert len(submits(pre)) == 1 and "prefill_submitted" not in router.flights.by_request["b"].timeline
            wa = submits(pre)[0]
            pre.held.pop(wa)
            await p.call("emit", [PrefillEvent(wa, "first_token", [7], "a"), PrefillEvent(wa, "transfer_done")])
            assert (await fa).new_token_ids == [7]
            await until(lambda: len(submits(pre)) == 2)  # a's push ended: b's opens
            assert submits(pre)[1].startswith("b#")
            await router.abort("b")
            assert (await fb).finish_reason == "abort"
            await until(lambda: len(submits(pre)) == 3)  # b's cancel stopped its push: c's opens
            for rid, gen in (("a", ga), ("c", gc)):
                await router.abort(rid)
            assert [d.finish_reason async for d in ga][-1] == "abort" and (await fc).finish_reason == "abort"
            await settled(router, fakes)
            assert not router.holdings.slots and router.holdings.streams[router.workers["decode"][0]]._value == 1
        finally:
            await router.shutdown()
    run(main)
