"""Admission and placement for `ClusterRouter` (a mixin, like `cluster.recovery.RecoveryMixin`).

    _admission()          the loop: waiting flights in arrival order; the head that cannot be placed
                          (no pages, a pool awaiting its restart) waits for capacity
    _place(f)             disaggregated: `reserve` on a decode worker (prefix-aware order), then the
                          prefill `submit` as a task beside the loop (`_submit`); colocated: `add_request`
    _guarded(f, wid, st)  the error rules of a placement step: a typed error ends the flight, a lost worker
                          re-places it (`_recover`), a restarting pool keeps it queued; a step of a
                          placement the flight has left (a recovery gave it a new wid) changes nothing

Why `submit` runs beside the loop: the prefill worker answers it between steps (up to a whole prompt
chunk), and awaited in the loop it held every later flight behind it -- admission topped out near 1.3
req/s on the Azure code trace (queued -> reserved 2.8 s at 2 req/s). A `reserve` still runs in the loop:
its answer decides whether the head waits (FIFO by pages), and a decode step is short.
How the spawned submit ends (`_submit`): accepted -> the prefill side is open (`cancel` frees it when the
flight ends); a typed error -> the flight fails with it, its decode reservation is aborted when the flight
ends (`_release`) and the prefill worker gets an (idempotent) `cancel` for what it may hold; the prefill
worker lost -> `_ask` re-placed its flights; the flight ended meanwhile (abort, disconnect, deadline) ->
the prefill side is cancelled as soon as the submit answers; router shutdown -> the task is cancelled.
Other flights are never touched. Tasks go through the router's `_spawn` (kept and awaited by `shutdown`).

Uses the router's `cfg`, `workers`, `_waiting`, `_wake`, `_closed`, `_page_size`, `_prefix`, `_restarting`,
`_clock`, `_ask`, `_call`, `_spawn`, `_release`, `_recover`, `_check_heartbeats`. No Ray import here.
"""
from __future__ import annotations

import asyncio

from cluster.flight import Flight
from cluster.recovery import AwaitingRestart, Worker
from cluster.serving_api import BackendUnavailableError
from engine.errors import PdserveError


class AdmissionMixin:
    async def _admission(self) -> None:
        """Admit waiting flights in arrival order; when the head cannot be placed, wait for capacity."""
        while not self._closed:
            try:
                await asyncio.wait_for(self._wake.wait(), 0.05)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            self._check_heartbeats()
            while self._waiting:
                f = self._waiting.pop(0)  # (a recovery during _place puts it back at the head)
                if not f.done and not await self._place(f):
                    self._waiting.insert(0, f)
                    break

    async def _place(self, f: Flight) -> bool:
        """Try to start `f` on workers; False when none can take it now. Errors end `f`."""
        place = self._place_colocated if self.cfg.mode == "colocated" else self._place_disaggregated
        return await self._guarded(f, f.wid, place(f))

    async def _guarded(self, f: Flight, wid: str, step) -> bool:
        """Run `step` (a coroutine placing `f` under worker id `wid`) by the error rules in the module map.
        False only while a pool awaits its restart (`f` stays queued)."""
        try:
            return await step
        except AwaitingRestart:  # every worker of a pool is down and one is restarting: keep it queued
            return False
        except Exception as e:  # noqa: BLE001 - a bug here must fail one request, not stop admission
            if f.wid != wid or f.done:  # a recovery re-placed it (that placement decides) or it ended
                return True
            if isinstance(e, BackendUnavailableError):  # a worker died under the call: place it elsewhere
                self._recover(f, e)
            elif isinstance(e, PdserveError):
                f.queue.put_nowait(e)
            else:
                f.queue.put_nowait(BackendUnavailableError(f"placing {f.req.request_id}: {type(e).__name__}: {e}"))
        return True

    def _alive(self, pool: str) -> list[Worker]:
        live = [w for w in self.workers[pool] if w.alive]
        if not live:
            if self._restarting.get(pool):  # Ray is restarting one: wait for it (the deadline still bounds)
                raise AwaitingRestart(pool)
            raise BackendUnavailableError(f"no live {pool} worker")
        return live

    async def _place_disaggregated(self, f: Flight) -> bool:
        wid, prompt = f.wid, f.run_prompt
        self._alive("prefill")  # before anything is reserved: a pool awaiting its restart makes us wait
        need = -(-len(prompt) // self._page_size)
        lease = max(f.deadline - self._clock(), 0.0) + self.cfg.lease_margin_s
        desc, px = None, self._prefix
        dh = px.hashes("decode", prompt)
        for w in px.decode_order(self._alive("decode"), dh, len(prompt), need):  # warm and roomy first
            desc = await self._ask(w, "reserve", wid, prompt, f.run_params, lease)
            if desc is not None:
                break
        if desc is None:
            return False
        w.pages_claimed += need
        if f.done or not w.alive:  # ended while reserving (_end did not know the decode side), or w died
            self._spawn(self._call(w, "abort", wid))
            if not f.done:
                self._recover(f, BackendUnavailableError(f"worker {w.handle.name} died while reserving"))
            return True
        f.decode, f.decode_open = w, True
        w.flights.add(f.wid)
        px.record("decode", w, dh)
        f.mark("reserved")
        ph = px.hashes("prefill", prompt)
        p, f.prefill_tokens = px.pick_prefill(self._alive("prefill"), ph, len(prompt))  # queued + uncached
        f.prefill, f.prefill_tokens_counted = p, True
        p.queued_tokens += f.prefill_tokens  # (now: the next flight's pick already sees this load)
        p.flights.add(wid)
        f.mark("prefill_submitted")  # (sent now; stamped before the task runs, so a fast finish still sees it)
        self._spawn(self._guarded(f, wid, self._submit(f, wid, prompt, f.run_params, p, w, desc, ph)))
        return True

    async def _submit(self, f: Flight, wid: str, prompt, params, p: Worker, w: Worker, desc, ph) -> bool:
        """Hand reserved flight `f` (as `wid`: this placement's prompt and params, which a recovery may
        replace meanwhile) to prefill worker `p`; its KV goes to decode worker `w`."""
        try:
            await self._ask(p, "submit", wid, prompt, params, desc, w.handle.info["address"])
        except BackendUnavailableError:  # p is lost: `_ask` re-placed the flights p still owed something
            return True  # (not `_guarded`'s re-place: a flight whose KV already left p runs on untouched)
        except Exception:  # noqa: BLE001 - typed or not, `_guarded` fails the flight with it
            # (a refused submit normally leaves nothing there; cancel is idempotent and covers the rest)
            self._spawn(self._call(p, "cancel", wid))
            raise  # -> `_guarded`: the flight fails with it; its end aborts the decode reservation
        self._prefix.record("prefill", p, ph)
        if f.wid != wid:  # a worker loss re-queued it meanwhile: this placement is void
            self._spawn(self._call(p, "cancel", wid))
            return True
        f.prefill_open = not f.prefill_ended
        if f.done:  # ended while the submit was in flight: `_end` could not cancel what p had not taken
            self._release(f)
        return True

    async def _place_colocated(self, f: Flight) -> bool:
        ch = self._prefix.hashes("colocated", f.run_prompt)  # ([] unless its replicas cache prefixes)
        w = self._prefix.pick_colocated(self._alive("colocated"), ch, len(f.run_prompt))
        await self._ask(w, "add_request", f.wid, f.run_prompt, f.run_params)
        self._prefix.record("colocated", w, ch)
        if f.done:
            self._spawn(self._call(w, "abort", f.wid))
            return True
        f.decode, f.decode_open = w, True
        w.flights.add(f.wid)
        f.mark("engine_added")
        return True
