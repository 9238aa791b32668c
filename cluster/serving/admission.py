"""`Admission`: admission and placement for the router -- which workers a waiting flight goes to, and when.

    run()                 the loop: waiting flights in arrival order; the head that cannot be placed
                          (no pages, a pool awaiting a replacement) waits for capacity
    place(f)              disaggregated: `reserve` on a decode worker (prefix-aware order), then the
                          prefill `submit` as a task beside the loop (`_submit`); colocated: `add_request`
    _guarded(f, wid, st)  the error rules of a placement step: a typed error ends the flight, a lost worker
                          re-places it (`Recovery.recover`), a pool awaiting a replacement keeps it
                          queued; a step of a placement the flight has left (a recovery gave it a new wid)
                          changes nothing

The router owns one; everything it reads and changes is passed in: the pools' `PoolMembership`s (it picks
among `placeable()` members: never a draining or fenced one), the `FlightTable` (the FIFO it takes from),
`Holdings` (KV receive streams, cleanup calls), `Recovery` (placement commands go through its `ask`, which
loses a worker that fails or does not answer; its watchdog runs on this loop), the `PrefixPlacer`, the
`Tasks` it runs submits with, and the clock. No Ray import here.

Why `submit` runs beside the loop: the prefill worker answers it between steps (up to a whole prompt
chunk), and awaited in the loop it held every later flight behind it -- admission topped out near 1.3
req/s on the Azure code trace (queued -> reserved 2.8 s at 2 req/s). A `reserve` still runs in the loop:
its answer decides whether the head waits (FIFO by pages), and a decode step is short.
How the spawned submit ends (`_submit`): accepted -> the prefill side is open (`cancel` frees it when the
flight ends); a typed error -> the flight fails with it, its decode reservation is aborted when the flight
ends (`Holdings.release`) and the prefill worker gets an (idempotent) `cancel` for what it may hold; the
prefill worker lost -> `ask` re-placed its flights; the flight ended meanwhile (abort, disconnect,
deadline) -> the prefill side is cancelled as soon as the submit answers; router shutdown -> the task is
cancelled. Other flights are never touched. A submit first takes one of its decode worker's KV receive
streams (`Holdings`: why, and when it is freed).
"""
from __future__ import annotations

import asyncio
from typing import Callable

from cluster.serving.flight import Flight, FlightTable
from cluster.serving.holdings import Holdings
from cluster.serving.membership import AwaitingRestart, PoolMembership, Worker
from cluster.serving.prefix_routing import PrefixPlacer
from cluster.serving.recovery import Recovery
from cluster.serving.tasks import Tasks
from cluster.serving_api import BackendUnavailableError
from engine.errors import PdserveError


class Admission:
    def __init__(self, cfg, pools: dict[str, PoolMembership], flights: FlightTable, holdings: Holdings,
                 recovery: Recovery, prefix: PrefixPlacer, tasks: Tasks, page_size: int,
                 clock: Callable[[], float]):
        """`cfg`: the router's `RouterConfig` (mode, lease margin); `page_size`: the decode pool's KV page
        size (tokens), to count the pages a prompt needs; `clock`: monotonic seconds (deadlines)."""
        self.cfg, self.pools, self.flights, self.holdings = cfg, pools, flights, holdings
        self.recovery, self.prefix, self.tasks = recovery, prefix, tasks
        self.page_size, self.clock = page_size, clock

    async def run(self) -> None:
        """Admit waiting flights in arrival order; when the head cannot be placed, wait for capacity."""
        waiting, wake = self.flights.waiting, self.flights.wake
        while not self.tasks.closed:
            try:
                await asyncio.wait_for(wake.wait(), 0.05)
            except asyncio.TimeoutError:
                pass
            wake.clear()
            self.recovery.check_heartbeats()
            while waiting:
                f = waiting.pop(0)  # (a recovery during place puts it back at the head)
                if not f.done and not await self.place(f):
                    waiting.insert(0, f)
                    break

    async def place(self, f: Flight) -> bool:
        """Try to start `f` on workers; False when none can take it now. Errors end `f`."""
        place = self._place_colocated if self.cfg.mode == "colocated" else self._place_disaggregated
        return await self._guarded(f, f.wid, place(f))

    async def _guarded(self, f: Flight, wid: str, step) -> bool:
        """Run `step` (a coroutine placing `f` under worker id `wid`) by the error rules in the module map.
        False only while a pool awaits a replacement (`f` stays queued)."""
        try:
            return await step
        except AwaitingRestart:  # every worker of a pool is down and one is coming: keep it queued
            return False
        except Exception as e:  # noqa: BLE001 - a bug here must fail one request, not stop admission
            if f.wid != wid or f.done:  # a recovery re-placed it (that placement decides) or it ended
                return True
            if isinstance(e, BackendUnavailableError):  # a worker died under the call: place it elsewhere
                self.recovery.recover(f, e)
            elif isinstance(e, PdserveError):
                f.queue.put_nowait(e)
            else:
                f.queue.put_nowait(BackendUnavailableError(f"placing {f.req.request_id}: {type(e).__name__}: {e}"))
        return True

    async def _place_disaggregated(self, f: Flight) -> bool:
        wid, prompt, ask = f.wid, f.run_prompt, self.recovery.ask
        prefill, decode = self.pools["prefill"], self.pools["decode"]
        prefill.placeable()  # before anything is reserved: a pool awaiting a replacement makes us wait
        need = -(-len(prompt) // self.page_size)
        lease = max(f.deadline - self.clock(), 0.0) + self.cfg.lease_margin_s
        desc, px = None, self.prefix
        dh = px.hashes("decode", prompt)
        for w in px.decode_order(decode.placeable(), dh, len(prompt), need):  # warm and roomy first
            desc = await ask(w, "reserve", wid, prompt, f.run_params, lease)
            if desc is not None:
                break
        if desc is None:
            return False
        w.pages_claimed += need
        if f.done or not w.alive:  # ended while reserving (`_end` did not know the decode side), or w died
            self.tasks.spawn(self.holdings.call(w, "abort", wid))
            if not f.done:
                self.recovery.recover(f, BackendUnavailableError(f"worker {w.name} died while reserving"))
            return True
        f.decode, f.decode_open = w, True
        w.flights.add(f.wid)
        px.record("decode", w, dh)
        f.mark("reserved")
        ph = px.hashes("prefill", prompt)
        p, f.prefill_tokens = px.pick_prefill(prefill.placeable(), ph, len(prompt))  # queued + uncached
        f.prefill, f.prefill_tokens_counted = p, True
        p.queued_tokens += f.prefill_tokens  # (now: the next flight's pick already sees this load)
        p.flights.add(wid)
        self.tasks.spawn(self._guarded(f, wid, self._submit(f, wid, prompt, f.run_params, p, w, desc, ph)))
        return True

    async def _submit(self, f: Flight, wid: str, prompt, params, p: Worker, w: Worker, desc, ph) -> bool:
        """Hand reserved flight `f` (as `wid`: this placement's prompt and params, which a recovery may
        replace meanwhile) to prefill worker `p`; its KV goes to decode worker `w`, over one of `w`'s
        receive streams: the push opens once `p` computes the prompt's first layer, and `w` refuses pushes
        beyond its gRPC server's limit (`kv_streams_per_decode`), so a burst waits here for a stream, in
        arrival order. The stream is this task's until the call answers, then the push's (`Holdings`)."""
        stream = self.holdings.stream_of(w)
        await stream.acquire()
        if f.wid != wid or f.done:  # re-placed or ended while it waited: nothing was sent
            stream.release()
            return True
        f.mark("prefill_submitted")  # (before the call: a fast finish still sees it)
        try:
            await self.recovery.ask(p, "submit", wid, prompt, params, desc, w.handle.info["address"])
        except BackendUnavailableError:  # p is lost: `ask` re-placed the flights p still owed something
            stream.release()  # (its pushes died with it)
            return True  # (not `_guarded`'s re-place: a flight whose KV already left p runs on untouched)
        except Exception:  # noqa: BLE001 - typed or not, `_guarded` fails the flight with it
            stream.release()  # (a refused submit opened no push)
            self.tasks.spawn(self.holdings.call(p, "cancel", wid))  # (normally nothing there; idempotent)
            raise  # -> `_guarded`: the flight fails with it; its end aborts the decode reservation
        self.prefix.record("prefill", p, ph)
        if f.wid == wid and f.prefill_ended:  # its push already ended (the events outran the answer)
            stream.release()
            return True
        self.holdings.hold_stream(wid, stream)
        if f.wid != wid:  # a worker loss re-queued it meanwhile: this placement is void
            self.tasks.spawn(self.holdings.cancel_prefill(p, wid))
            return True
        f.prefill_open = True
        if f.done:  # ended while the submit was in flight: `_end` could not cancel what p had not taken
            self.holdings.release(f)
        return True

    async def _place_colocated(self, f: Flight) -> bool:
        ch = self.prefix.hashes("colocated", f.run_prompt)  # ([] unless its replicas cache prefixes)
        w = self.prefix.pick_colocated(self.pools["colocated"].placeable(), ch, len(f.run_prompt))
        await self.recovery.ask(w, "add_request", f.wid, f.run_prompt, f.run_params)
        self.prefix.record("colocated", w, ch)
        if f.done:
            self.tasks.spawn(self.holdings.call(w, "abort", f.wid))
            return True
        f.decode, f.decode_open = w, True
        w.flights.add(f.wid)
        f.mark("engine_added")
        return True
