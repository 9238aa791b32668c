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
KV receive streams: a push opens when its prompt's first layer is computed (`KVSender`), and a decode
worker's gRPC server refuses pushes beyond its `max_streams` (8): a prefill batch of up to max_num_seqs
prompts plus those still shipping (from several prefill workers) can pass that, and each refused push is a
failed transfer (under policy "fail" a failed request). So a submit
first takes one of its decode worker's `kv_streams_per_decode` streams (FIFO); the push's end frees it as
the event arrives (`Inbox`, not when the client reads it), or the cancel that stops the push does.

Uses the router's `cfg`, `workers`, `_waiting`, `_wake`, `_closed`, `_page_size`, `_prefix`, `_restarting`,
`_clock`, `_streams`, `_slots`, `_ask`, `_call`, `_spawn`, `_release`, `_cancel_prefill`, `_recover`,
`_check_heartbeats`. No Ray import here.
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable

from cluster.flight import Flight
from cluster.recovery import AwaitingRestart, Worker
from cluster.serving_api import BackendUnavailableError
from engine.errors import PdserveError
from prefill_worker.worker import PrefillEvent

PUSH_ENDS = ("finished", "transfer_done", "transfer_failed")  # prefill events sent after its push closed


class Inbox(asyncio.Queue):
    """A flight's queue of worker events and router signals; the router sees each item as it arrives
    (`on_arrival`), not when the client reads it, so a slow reader holds no resource other flights need."""

    def __init__(self, on_arrival: Callable[[Any], None]):
        super().__init__()
        self._on_arrival = on_arrival

    def put_nowait(self, item) -> None:
        self._on_arrival(item)
        super().put_nowait(item)


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
        self._spawn(self._guarded(f, wid, self._submit(f, wid, prompt, f.run_params, p, w, desc, ph)))
        return True

    async def _submit(self, f: Flight, wid: str, prompt, params, p: Worker, w: Worker, desc, ph) -> bool:
        """Hand reserved flight `f` (as `wid`: this placement's prompt and params, which a recovery may
        replace meanwhile) to prefill worker `p`; its KV goes to decode worker `w`, over one of `w`'s
        receive streams: the push opens once `p` computes the prompt's first layer, and `w` refuses pushes
        beyond its gRPC server's limit (`kv_streams_per_decode`), so a burst waits here for a stream, in
        arrival order. The stream
        is this task's until the call answers, then `_slots`' (freed by `_free_stream` at the transfer's
        end, or after the cancel that stops the push)."""
        stream = self._streams.setdefault(id(w), asyncio.Semaphore(max(1, self.cfg.kv_streams_per_decode)))
        await stream.acquire()
        if f.wid != wid or f.done:  # re-placed or ended while it waited: nothing was sent
            stream.release()
            return True
        f.mark("prefill_submitted")  # (before the call: a fast finish still sees it)
        try:
            await self._ask(p, "submit", wid, prompt, params, desc, w.handle.info["address"])
        except BackendUnavailableError:  # p is lost: `_ask` re-placed the flights p still owed something
            stream.release()  # (its pushes died with it)
            return True  # (not `_guarded`'s re-place: a flight whose KV already left p runs on untouched)
        except Exception:  # noqa: BLE001 - typed or not, `_guarded` fails the flight with it
            stream.release()  # (a refused submit opened no push)
            self._spawn(self._call(p, "cancel", wid))  # (it normally left nothing there; cancel is idempotent)
            raise  # -> `_guarded`: the flight fails with it; its end aborts the decode reservation
        self._prefix.record("prefill", p, ph)
        if f.wid == wid and f.prefill_ended:  # its push already ended (the events outran the answer)
            stream.release()
            return True
        self._slots[wid] = stream
        if f.wid != wid:  # a worker loss re-queued it meanwhile: this placement is void
            self._spawn(self._cancel_prefill(p, wid))
            return True
        f.prefill_open = True
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

    # ---- KV receive streams (module map) ---------------------------------------------------------
    def _on_arrival(self, item) -> None:
        if isinstance(item, PrefillEvent) and item.kind in PUSH_ENDS:
            self._free_stream(item.request_id)

    def _free_stream(self, wid: str) -> None:
        stream = self._slots.pop(wid, None)
        if stream is not None:
            stream.release()
