"""Router logic against fake workers (pure Python: no model, no transport, no Ray). The fakes keep pages as
counters, log the commands they get, and return from `step()` exactly the events a test `emit`s, so each
test builds one situation: the queue limit (429), deadlines while queued, placement by free pages and
queued prefill tokens, the two event streams reconciled in either order (a decode side that finishes
first streams its tokens and holds the finish for the prefill worker's last report), the ends (first-token stop,
abort, disconnect, failed transfer, dead worker) freeing both sides, and typed errors for bad requests.
A lost worker's requests that run out of recoveries (`max_recoveries`) fail typed; resuming them elsewhere
is tested on real workers in test_faults_tiny.py."""
from __future__ import annotations

import asyncio
import time

import pytest

from cluster.serving.router import ClusterRouter, RouterConfig
from cluster.serving_api import BackendUnavailableError, GenerateRequest, OverloadedError
from cluster.serving.worker_loop import DECODE_METHODS, PREFILL_METHODS, LocalHandle, WorkerLoop
from decode_worker.worker import DecodeDelta, DecodeStats
from engine import SamplingParams
from engine.errors import InvalidRequestError, UnknownModelError
from kv_transfer.contract import TransferDescriptor
from prefill_worker.worker import PrefillEvent, PrefillStats

PARAMS = SamplingParams(max_tokens=8, temperature=0.0)


class FakeDecode:
    def __init__(self, free_pages=8):
        self.free, self.held, self.out, self.log = free_pages, {}, [], []

    def reserve(self, rid, prompt, params, lease_s):
        self.log.append(("reserve", rid))
        need = -(-len(prompt) // 4)
        if need > self.free:
            return None
        self.free -= need
        self.held[rid] = need
        return TransferDescriptor(rid, f"res-{rid}", "nonce", "fp", "sig", len(prompt))

    def abort(self, rid):
        self.log.append(("abort", rid))
        self.free += self.held.pop(rid, 0)

    def fail_transfer(self, rid, reason):
        self.log.append(("fail_transfer", rid))

    def emit(self, events):
        self.out.extend(events)

    def has_work(self):
        return bool(self.out)

    def step(self):
        out, self.out = self.out, []
        return out

    def stats(self):
        return DecodeStats(free_pages=self.free, pages_in_use=sum(self.held.values()), reservations=len(self.held))

    def close(self):
        pass


class FakePrefill(FakeDecode):
    def submit(self, rid, prompt, params, desc, address):
        self.log.append(("submit", rid))
        self.held[rid] = len(prompt)

    def cancel(self, rid):
        self.log.append(("cancel", rid))
        self.held.pop(rid, None)

    def stats(self):
        return PrefillStats(queued_prefill_tokens=sum(self.held.values()))


class Tok:
    def encode(self, text):
        return [ord(c) % 50 for c in text]


def handle(name, fake, methods):
    return LocalHandle(name, WorkerLoop(lambda: fake, methods | {"emit"}, name), {"address": f"{name}:1"})


def make_router(decodes=(8,), prefills=1, **cfg):
    """prefills: how many `FakePrefill`s, or the fakes themselves."""
    pre = [FakePrefill() for _ in range(prefills)] if isinstance(prefills, int) else list(prefills)
    fakes = {"decode": [FakeDecode(p) for p in decodes], "prefill": pre}
    pools = {"decode": [handle(f"decode-{i}", f, DECODE_METHODS) for i, f in enumerate(fakes["decode"])],
             "prefill": [handle(f"prefill-{i}", f, PREFILL_METHODS) for i, f in enumerate(fakes["prefill"])]}
    config = RouterConfig(**{**dict(mode="disaggregated", model_name="m", vocab_size=50, max_model_len=64,
                                    kv_capacity_tokens=256, max_queued_requests=4, request_timeout_s=5.0,
                                    drain_timeout_s=0.05), **cfg})
    return ClusterRouter(config, pools, Tok(), page_size=4), fakes


async def until(pred, timeout_s=5.0):
    end = time.monotonic() + timeout_s
    while True:
        try:
            if pred():
                return
        except IndexError:  # (a log entry the predicate reads is not there yet)
            pass
        assert time.monotonic() < end, "condition not reached"
        await asyncio.sleep(0.005)


async def settled(router, fakes):
    """Leak check: nothing held by any fake, nothing left in the router."""
    await until(lambda: not router.flights.by_wid and all(not f.held for fs in fakes.values() for f in fs))


def start(router, rid, prompt=(1, 2, 3, 4, 5), **kw):
    gen = router.generate(GenerateRequest(rid, list(prompt), PARAMS, model="m", **kw))
    return gen, asyncio.ensure_future(gen.__anext__())


def run(test):
    async def main():
        router, fakes = make_router(**getattr(test, "router_kwargs", {}))
        try:
            await test(router, fakes)
            await settled(router, fakes)
        finally:
            await router.shutdown()
    asyncio.run(main())


def with_router(**kwargs):
    def wrap(test):
        test.router_kwargs = kwargs
        return lambda: run(test)
    return wrap


def wid_of(fake, kind="reserve", n=0):
    return [rid for k, rid in fake.log if k == kind][n]


@with_router(decodes=(0,), max_queued_requests=2)
async def test_queue_limit_answers_overloaded_and_deadlines_end_queued_requests(router, fakes):
    (g1, first1), (g2, first2) = start(router, "a"), start(router, "b", deadline_s=0.2)
    await until(lambda: len(router.flights.by_wid) == 2)
    with pytest.raises(OverloadedError, match="limit 2"):
        await start(router, "c")[1]
    assert (await first2).finish_reason == "timeout"  # never got pages: ends at its deadline
    assert (await router.stats()).queued == 1
    await router.abort("a")
    assert (await first1).finish_reason == "abort"
    assert not fakes["decode"][0].held and not fakes["prefill"][0].log


@with_router(decodes=(2, 8), prefills=2)
async def test_placement_by_free_pages_then_by_queued_prefill_tokens(router, fakes):
    await router.stats()
    await until(lambda: all(w.stats is not None for ws in router.workers.values() for w in ws))
    gens = [start(router, f"r{i}") for i in range(3)]  # 5 tokens = 2 pages each
    await until(lambda: sum(k == "submit" for f in fakes["prefill"] for k, _ in f.log) == 3)
    big, small = fakes["decode"][1], fakes["decode"][0]
    assert len(big.held) == 3 and not small.held  # 8 free pages beat 2; then 6, then 4 still beat 2
    assert [len(f.held) for f in fakes["prefill"]] == [2, 1]  # the idle prefill worker takes the second
    for i, (gen, first) in enumerate(gens):
        await router.abort(f"r{i}")
        assert (await first).finish_reason == "abort"
    await until(lambda: all(("abort", w) in big.log for w in list(big.held)) and not big.held)


@with_router()
async def test_first_token_from_prefill_then_decode_deltas_none_lost_or_repeated(router, fakes):
    gen, first = start(router, "r")
    dec, pre = fakes["decode"][0], fakes["prefill"][0]
    await until(lambda: ("submit", wid_of(dec)) in pre.log)
    wid, h = wid_of(dec), router.workers
    await h["prefill"][0].handle.call("emit", [PrefillEvent(wid, "first_token", [7], "a", prompt_token_ids=[1])])
    d1 = await first
    assert (d1.new_token_ids, d1.new_text, d1.finished) == ([7], "a", False)
    await h["decode"][0].handle.call("emit", [DecodeDelta(wid, [7, 8], "ab", 2, 2)])  # repeats the first token
    assert ((d2 := await gen.__anext__()).new_token_ids, d2.new_text) == ([8], "b")
    await h["prefill"][0].handle.call("emit", [PrefillEvent(wid, "transfer_done")])
    await h["decode"][0].handle.call("emit", [DecodeDelta(wid, [9], "c", 3, 3, True, "length")])
    d3 = await gen.__anext__()
    assert (d3.new_token_ids, d3.new_text, d3.finish_reason, d3.completion_tokens) == ([9], "c", "length", 3)
    dec.held.clear()  # the real workers free a finished request / a sent prefill themselves
    pre.held.clear()
    await gen.aclose()
    assert ("abort", wid) not in dec.log and ("cancel", wid) not in pre.log  # a clean end frees nothing twice


@with_router()
async def test_decode_ahead_of_prefill_event_and_stop_string_holdback(router, fakes):
    params = SamplingParams(max_tokens=8, temperature=0.0, stop=["END"])
    gen = router.generate(GenerateRequest("r", [1, 2, 3], params, model="m", return_timeline=True))
    first = asyncio.ensure_future(gen.__anext__())
    dec, pre = fakes["decode"][0], fakes["prefill"][0]
    await until(lambda: ("submit", wid_of(dec)) in pre.log)
    wid = wid_of(dec)
    await router.workers["decode"][0].handle.call("emit", [DecodeDelta(wid, [7, 8], "hi E", 2, 4)])
    d1 = await first
    assert (d1.new_token_ids, d1.new_text) == ([7, 8], "hi ")  # "E" may start "END": held back
    await router.workers["prefill"][0].handle.call("emit", [PrefillEvent(wid, "first_token", [7], "h")])
    await router.workers["decode"][0].handle.call("emit", [DecodeDelta(wid, [9], "x", 3, 5, True, "stop")])
    d2 = await gen.__anext__()  # the late prefill event added nothing; the last tokens stream at once
    assert (d2.new_token_ids, d2.new_text, d2.finished) == ([9], "Ex", False)
    dec.held.clear()
    pre.held.clear()  # (the real prefill worker frees a sent prefill itself)
    await router.workers["prefill"][0].handle.call("emit", [PrefillEvent(wid, "transfer_done",
                                                                         times={"transfer_done": 1.0})])
    d3 = await gen.__anext__()  # the finish waited for the prefill worker's last report: a complete timeline
    assert (d3.new_token_ids, d3.new_text, d3.finished, d3.finish_reason) == ([], "", True, "stop")
    assert d3.timeline["transfer_done"] == 1.0 and d3.timeline["finish"] > 1.0
    assert ("cancel", wid) not in pre.log


@with_router()
async def test_stop_at_the_first_token_frees_the_decode_reservation(router, fakes):
    gen, first = start(router, "r")
    dec, pre = fakes["decode"][0], fakes["prefill"][0]
    await until(lambda: ("submit", wid_of(dec)) in pre.log)
    wid = wid_of(dec)
    pre.held.clear()  # the real prefill worker has already freed a request that ended
    await router.workers["prefill"][0].handle.call("emit", [PrefillEvent(wid, "finished", [2], "", "stop")])
    d = await first
    assert (d.new_token_ids, d.finished, d.finish_reason) == ([2], True, "stop")
    await until(lambda: ("abort", wid) in dec.log)
    assert ("cancel", wid) not in pre.log


@with_router()
async def test_disconnect_and_deadline_after_admission_free_both_sides(router, fakes):
    dec, pre = fakes["decode"][0], fakes["prefill"][0]
    gen, first = start(router, "gone")
    await until(lambda: ("submit", wid_of(dec)) in pre.log)
    first.cancel()  # the client went away: its handler task is cancelled mid-wait
    with pytest.raises(asyncio.CancelledError):
        await first
    await gen.aclose()
    wid = wid_of(dec)
    await until(lambda: ("abort", wid) in dec.log and ("cancel", wid) in pre.log)
    gen, first = start(router, "late", deadline_s=0.3)
    assert (await first).finish_reason == "timeout"
    wid = wid_of(dec, n=1)
    await until(lambda: ("abort", wid) in dec.log and ("cancel", wid) in pre.log)


@with_router()
async def test_failed_transfer_goes_to_the_decode_worker_and_its_error_is_typed(router, fakes):
    dec, pre = fakes["decode"][0], fakes["prefill"][0]
    gen, first = start(router, "r")
    await until(lambda: ("submit", wid_of(dec)) in pre.log)
    wid = wid_of(dec)
    pre.held.clear()
    await router.workers["prefill"][0].handle.call("emit", [PrefillEvent(wid, "transfer_failed", reason="boom")])
    await until(lambda: ("fail_transfer", wid) in dec.log)
    dec.held.clear()  # policy "fail": the decode worker ends the request and says so
    await router.workers["decode"][0].handle.call("emit", [DecodeDelta(wid, [], "", 0, 0, True, "error",
                                                                        error="KV transfer failed: boom")])
    with pytest.raises(BackendUnavailableError, match="boom"):
        await first


@with_router(decodes=(8, 8), max_recoveries=0)  # (recovery: tests/unit/test_faults_tiny.py)
async def test_a_dead_worker_fails_its_requests_without_recoveries_and_is_skipped(router, fakes):
    gen, first = start(router, "r")
    await until(lambda: any(f.log for f in fakes["decode"]))
    i = next(i for i, f in enumerate(fakes["decode"]) if f.log)
    fakes["decode"][i].held.clear()
    router.workers["decode"][i].handle.loop.stop()  # its loop ends: drain raises, calls fail
    with pytest.raises(BackendUnavailableError):
        await first
    fakes["prefill"][0].held.clear()
    gen, first = start(router, "r2")
    await until(lambda: fakes["decode"][1 - i].log)
    await router.abort("r2")
    assert (await first).finish_reason == "abort"


@with_router()
async def test_bad_requests_are_typed_errors(router, fakes):
    bad = [(GenerateRequest("x", [1], PARAMS, model="other"), UnknownModelError),
           (GenerateRequest("x", [], PARAMS, model="m"), InvalidRequestError),
           (GenerateRequest("x", [99], PARAMS, model="m"), InvalidRequestError),
           (GenerateRequest("x", [1] * 60, PARAMS, model="m"), InvalidRequestError),
           (GenerateRequest("x", [1], SamplingParams(max_tokens=0), model="m"), InvalidRequestError)]
    for req, err in bad:
        with pytest.raises(err):
            await router.generate(req).__anext__()
    gen, first = start(router, "dup")
    with pytest.raises(InvalidRequestError, match="in flight"):
        await start(router, "dup")[1]
    await router.abort("dup")
    assert (await first).finish_reason == "abort"
    assert PARAMS.seed is None  # the router fixed a seed on its own copy


def test_worker_loop_refuses_unknown_commands_and_reports_a_crashed_step():
    class Crashes(FakeDecode):
        def step(self):
            raise RuntimeError("bug")

    fake = Crashes()
    loop = WorkerLoop(lambda: fake, DECODE_METHODS | {"emit"}, "w")
    with pytest.raises(AttributeError, match="not a command"):
        loop.call("close")
    loop.call("emit", [1])
    with pytest.raises(BackendUnavailableError, match="step failed: RuntimeError: bug"):
        end = time.monotonic() + 5
        while time.monotonic() < end:
            loop.drain(0.05)
    with pytest.raises(BackendUnavailableError, match="stopped"):
        loop.call("stats")
    loop.stop()
    assert not loop.alive
