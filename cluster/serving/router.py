"""`ClusterRouter`: the `ServingBackend` over pools of workers -- disaggregated or colocated.

Who calls it: the HTTP frontend / Python client through `cluster.serving_api` (`generate`, `abort`,
`stats`, `shutdown`). It talks to workers only through handles with `call(method, *args)`,
`drain(timeout_s)` and `close()`: Ray actors (`cluster/actors.py`, built by `ClusterRouter.from_spec`) or
in-process `WorkerLoop`s (`cluster.worker_loop.LocalHandle`; unit tests). No Ray import here.

Life of a request (disaggregated; DESIGN.md "Life of a request"):
  1. `generate()` validates and tokenizes (typed 400s), fixes a seed, checks the queue limit (requests
     without a first token yet; beyond `max_queued_requests` -> `OverloadedError`, 429) and joins the FIFO.
  2. The admission task (`cluster/admission.py`) takes the head: decode worker with the most free pages,
     then the least load; `reserve` there (None = no pages now: the next worker, else wait for capacity);
     then the prefill worker with the fewest queued prefill tokens gets `submit(prompt, descriptor, decode
     address)` from a task beside the loop (the call waits for that worker's current step; it waits
     first for one of the decode worker's `kv_streams_per_decode` receive streams): it prefills and
     ships each layer's KV as computed. With prefix caching (`prefix_routing`, on where the
     workers cache), `cluster/prefix_routing.PrefixPlacer` orders both choices by cached prefix against load
     (never a decode worker short of pages), and the reservation's `kv_start` tells the prefill worker
     which KV the decode side already holds.
  3. One poller per worker long-polls `drain()`; events go to their flight's queue. The prefill's first
     token is streamed at once (TTFT); decode deltas follow; `Flight.advance` reconciles the two streams.
  4. The request ends exactly once: finished (decode's last delta, or the prefill's when it stopped at
     its first token), "timeout" at its deadline (request's `deadline_s` or the server default), "abort"
     on `abort()`, or a typed error (a failed transfer under policy "fail", a dead worker). Whatever a
     worker may still hold -- reservation, running request, held prefill pages, transfer -- is freed by
     `abort`/`cancel` on both sides, also when the caller stops iterating (client disconnect).
  5. A lost worker (drain or call failed, or no heartbeat within `heartbeat_timeout_s` on the injectable
     `clock`) does not end the requests it harmed: they are re-placed elsewhere and resume where their
     stream stopped (`cluster/recovery.py`); the ledger there counts how every admitted request ended.
Colocated: step 2 is `add_request` on the replica with the least load; every event is a decode delta.
Timelines: the router marks its own events; workers' `times` (prefill, transfer, decode) are folded in,
and the decode worker's per-request KV figures (`DecodeDelta.kv`: kv_bytes, kv_pages -- counts, not times).
The terminal delta carries the final, complete timeline: when the decode side finishes before the prefill
worker's last report (transfer_done / transfer_failed) is drained, its tokens stream at once and the
terminal delta waits for that report (`_hold_finish`; bounded by the deadline and that worker's life).
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from cluster.admission import PUSH_ENDS, AdmissionMixin, Inbox
from cluster.flight import Flight
from cluster.intake import validate_request
from cluster.prefix_routing import PrefixPlacer
from cluster.recovery import Ledger, RecoveryMixin, Worker, WorkerHandle, outcome_of
from cluster.serving_api import (BackendStats, BackendUnavailableError, GenerateDelta, GenerateRequest,
                                 OverloadedError)
from decode_worker.worker import DecodeDelta
from engine.errors import InvalidRequestError, PdserveError, UnknownModelError
from kv_transfer.config import ReceiverConfig
from prefill_worker.worker import PrefillEvent

_TIMEOUT, _ABORT, _FINAL = "timeout", "abort", "final"  # router signals (_FINAL: see `_next_item`)
log = logging.getLogger("pdserve.router")


@dataclass(frozen=True)
class RouterConfig:
    mode: str  # "disaggregated" | "colocated"
    model_name: str
    vocab_size: int
    max_model_len: int  # prompt + output, the smallest over the pools
    kv_capacity_tokens: int  # the smallest decode/colocated KV pool (tokens): prompt + output must fit
    prefill_capacity_tokens: int | None = None  # the smallest prefill KV pool: the prompt must fit
    max_queued_requests: int = 256
    request_timeout_s: float = 120.0
    lease_margin_s: float = 5.0  # reservations outlive the request's deadline by this much
    drain_timeout_s: float = 0.5  # long-poll length (events return at once)
    heartbeat_timeout_s: float = 30.0  # a worker whose drain has not returned for this long is dead
    max_recoveries: int = 2  # re-placements of one request after worker losses before it fails
    call_timeout_s: float = 30.0  # a placement command unanswered this long: its worker is lost
    rejoin_restarted: bool = False  # take a lost worker's restarted incarnation back (Ray restarts actors)
    prefix_routing: bool | None = None  # route by cached prefix (cluster/prefix_routing.py); None: where workers cache
    prefix_cache_weight: float = 1.0  # one cached prompt token against one queued token
    decode_load_tokens: float = 64.0  # a decode worker's request in flight, in prompt tokens to ship
    prefix_refresh_s: float = 5.0  # replace the prefix index by the workers' reports this often (0: never)
    # pushes open into one decode worker at once: its gRPC server refuses more than max_streams, and a push
    # the router saw end may still hold a server thread for a moment (a client deadline or cancel unwinding)
    kv_streams_per_decode: int = ReceiverConfig.max_streams - 2


class ClusterRouter(AdmissionMixin, RecoveryMixin):
    def __init__(self, config: RouterConfig, pools: dict[str, list[WorkerHandle]], tokenizer,
                 page_size: int = 16, teardown=None, clock: Callable[[], float] = time.monotonic):
        """`pools`: "prefill" and "decode" handles (disaggregated) or "colocated" ones; `teardown`: an
        async callable run last by `shutdown()` (Ray: kill actors, remove placement groups); `clock`:
        monotonic seconds for deadlines and heartbeats (tests inject one)."""
        self.cfg = config
        self.model_name = config.model_name
        self._tokenizer = tokenizer
        self._page_size = page_size
        self._teardown = teardown
        self.workers = {pool: [Worker(h, pool) for h in hs] for pool, hs in pools.items()}
        self._flights: dict[str, Flight] = {}  # wid -> flight
        self._by_request: dict[str, Flight] = {}  # client request id -> flight
        self._waiting: list[Flight] = []  # FIFO of flights not yet admitted
        self._ids = itertools.count()
        self._wake: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []
        self._spawned: set[asyncio.Task] = set()  # submits and cleanup calls beside the loop (see _spawn)
        self._finals: dict[str, DecodeDelta] = {}  # wid -> decode's last delta, held for the prefill's report
        self._streams: dict[int, asyncio.Semaphore] = {}  # id(decode worker) -> its free KV receive streams
        self._slots: dict[str, asyncio.Semaphore] = {}  # wid -> the stream its push holds (admission.py)
        self._closed = False
        self._clock = clock
        self.ledger = Ledger()
        self._restarting: dict[str, int] = {}  # pool -> lost workers whose restarted actor is awaited
        infos = {pool: [(h.name, getattr(h, "info", None)) for h in hs] for pool, hs in pools.items()}
        self._prefix = PrefixPlacer(infos, config.prefix_routing, config.prefix_cache_weight,
                                    config.decode_load_tokens)

    @classmethod
    def from_spec(cls, spec, **kwargs) -> "ClusterRouter":
        """Start the spec's pools as Ray actors (starting or joining Ray) and route over them."""
        from cluster.actors import start_cluster  # the only path that imports ray

        return start_cluster(spec, cls, **kwargs)

    # ---- ServingBackend ----------------------------------------------------------------------
    def tokenizer(self):
        return self._tokenizer

    async def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        f = self._open(req)
        outcome = "cancelled"  # unless it ends below: the caller stopped iterating (disconnect)
        try:
            while True:
                item = await self._next_item(f)
                try:
                    delta = self._apply(f, item)
                except BaseException:
                    outcome = "failed"
                    raise
                if f.done:  # free before the last yield: a caller may never resume the generator after it
                    outcome = outcome_of(delta.finish_reason if delta is not None else None)
                    self._end(f, outcome)
                if delta is not None:
                    yield delta
                if f.done:
                    return
        finally:
            self._end(f, outcome)  # normal end, error, timeout, or the caller stopped iterating

    async def abort(self, request_id: str) -> None:
        f = self._by_request.get(request_id)
        if f is not None and not f.done:
            f.queue.put_nowait(_ABORT)

    async def stats(self) -> BackendStats:
        self._ensure_started()
        everyone = [w for ws in self.workers.values() for w in ws if w.stats is not None and w.alive]
        queued = sum(f.queued for f in self._flights.values())
        extra = {f"{w.handle.name}.{k}": float(v) for w in everyone for k, v in dataclasses.asdict(w.stats).items()
                 if isinstance(v, (int, float))}
        senders = [w.stats for w in everyone if w.pool == "prefill"]  # totals the /metrics gauges read
        extra["kv_transfer_bytes"] = float(sum(s.kv_bytes_sent for s in senders))
        extra["kv_transfer_seconds"] = float(sum(s.kv_transfer_seconds for s in senders))
        extra.update(self.ledger.extra(len(self._flights)))
        extra.update(self._prefix.extra(everyone))
        return BackendStats(queued, len(self._flights) - queued, sum(w.stats.pages_in_use for w in everyone),
                            sum(w.stats.num_pages for w in everyone),
                            sum(w.stats.num_preemptions for w in everyone if w.pool != "prefill"), extra)

    async def worker_stats(self) -> dict[str, Any]:
        """Fresh stats of every live worker, by name (tests: leak checks, preemption counters)."""
        out = {}
        for w in (w for ws in self.workers.values() for w in ws if w.alive):
            out[w.handle.name] = await w.handle.call("stats")
        return out

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for f in list(self._flights.values()):
            f.queue.put_nowait(BackendUnavailableError("the router is shutting down"))
        for t in [*self._tasks, *self._spawned]:  # (a submit or cleanup call may wait on a wedged worker)
            t.cancel()
        await asyncio.gather(*self._tasks, *self._spawned, return_exceptions=True)
        await asyncio.gather(*(w.handle.close() for ws in self.workers.values() for w in ws), return_exceptions=True)
        if self._teardown is not None:
            await self._teardown()

    # ---- intake ------------------------------------------------------------------------------
    def _open(self, req: GenerateRequest) -> Flight:
        if self._closed:
            raise BackendUnavailableError("the router is shut down")
        if req.model != self.model_name:
            raise UnknownModelError(req.model, f"this server serves {self.model_name!r}")
        prompt_ids, params = validate_request(req, self.cfg, self._tokenizer)
        if req.request_id in self._by_request:
            raise InvalidRequestError("request_id", f"{req.request_id!r} is already in flight")
        queued = sum(f.queued for f in self._flights.values())
        if queued >= self.cfg.max_queued_requests:
            raise OverloadedError(f"{queued} requests are queued (limit {self.cfg.max_queued_requests}); retry later")
        self._ensure_started()
        timeout = req.deadline_s if req.deadline_s is not None else self.cfg.request_timeout_s
        f = Flight(req, f"{req.request_id}#{next(self._ids)}", prompt_ids, params, self._clock() + timeout,
                   Inbox(self._on_arrival))
        f.mark("queued")
        self.ledger.admitted += 1
        self._flights[f.wid] = f
        self._by_request[req.request_id] = f
        self._waiting.append(f)
        self._wake.set()
        return f

    # ---- events -> deltas --------------------------------------------------------------------
    async def _next_item(self, f: Flight):
        """`f`'s next event or router signal; _TIMEOUT at its deadline. While `f`'s finish is held for its
        prefill worker's last report (`_finals`), it also wakes every `drain_timeout_s` to see whether that
        worker was lost: then (or at the deadline) _FINAL finishes it without the report."""
        while True:
            remaining, held = f.deadline - self._clock(), f.wid in self._finals
            if remaining <= 0:
                return _FINAL if held else _TIMEOUT
            try:
                return await asyncio.wait_for(f.queue.get(), min(remaining, self.cfg.drain_timeout_s)
                                              if held else remaining)
            except asyncio.TimeoutError:
                if not held:
                    return _TIMEOUT
                if not f.prefill.alive:
                    return _FINAL

    def _apply(self, f: Flight, item) -> GenerateDelta | None:
        if item == _FINAL:
            return self._finish_held(f)
        if item == _TIMEOUT or item == _ABORT:
            return f.final(item)
        if isinstance(item, BaseException):
            f.done = True
            raise item
        if getattr(item, "request_id", f.wid) != f.wid:
            return None  # a late event of a placement the flight left (a lost worker): already re-run
        for event, t in (getattr(item, "times", None) or {}).items():  # worker-side timeline events
            f.timeline.setdefault(event, t)
        for name, n in (getattr(item, "kv", None) or {}).items():  # the placement that finished it counts
            f.timeline[name] = float(n)
        if isinstance(item, PrefillEvent):
            return self._on_prefill(f, item)
        assert isinstance(item, DecodeDelta), item
        if item.error is not None:
            f.decode_open = False  # the decode worker already ended it
            if f.prefill is not None and not f.prefill_ended:  # the KV failed: maybe its prefill worker died
                self._spawn(self._confirm_failure(f, f.wid, item.error))
                return None
            f.done = True
            raise BackendUnavailableError(f"request {f.req.request_id}: {item.error}")
        if item.finished:
            f.decode_open = False
            if f.prefill is not None and not f.prefill_ended and f.prefill.alive:
                return self._hold_finish(f, item)
        return f.advance(item.new_token_ids, item.num_output, item.new_text, item.text_len, item.logprobs,
                         item.finished, item.finish_reason)

    def _on_prefill(self, f: Flight, ev: PrefillEvent) -> GenerateDelta | None:
        if ev.kind in ("first_token", "finished"):
            self._uncount_prefill(f)
        if ev.kind in PUSH_ENDS:
            f.prefill_open, f.prefill_ended = False, True
            self._free_stream(f.wid)  # (freed on arrival already, unless it outran the submit's answer)
            if f.wid in self._finals:  # the decode side finished first: the record is complete now
                return self._finish_held(f)
        if ev.kind == "transfer_failed":
            if self.cfg.mode == "disaggregated" and f.decode is not None and f.decode_open:
                self._spawn(self._call(f.decode, "fail_transfer", f.wid, ev.reason or "transfer failed"))
            return None  # the decode worker applies the failure policy and reports what follows
        if ev.kind in ("first_token", "finished"):
            n = len(ev.token_ids)
            return f.advance(ev.token_ids, n, ev.text, len(ev.text), ev.logprobs, ev.kind == "finished",
                             ev.finish_reason)
        return None

    def _hold_finish(self, f: Flight, item: DecodeDelta) -> GenerateDelta | None:
        """The decode worker finished `f` before its prefill worker's last report (transfer_done, or
        transfer_failed under policy "recompute") was drained: that worker reports after its current
        step. Stream the tokens now, hold the terminal delta until the report arrives (`_on_prefill`), so
        the timeline that delta carries -- and /v1 timelines and /metrics read -- is complete. The KV
        is in, so losing the prefill worker no longer harms `f` (it leaves that worker's flights; the
        hold then ends without the report, as it does at the deadline: `_next_item`)."""
        self._finals[f.wid] = item
        f.prefill.flights.discard(f.wid)
        return f.advance(item.new_token_ids, item.num_output, item.new_text, item.text_len, item.logprobs)

    def _finish_held(self, f: Flight) -> GenerateDelta | None:
        item = self._finals.pop(f.wid)  # (its tokens and text were streamed by `_hold_finish`)
        return f.advance([], item.num_output, "", item.text_len, None, True, item.finish_reason)

    # ---- admission ---------------------------------------------------------------------------
    def _ensure_started(self) -> None:
        if self._wake is not None:
            return
        self._wake = asyncio.Event()
        self._tasks.append(asyncio.create_task(self._admission()))
        for ws in self.workers.values():
            self._tasks += [asyncio.create_task(self._poll(w)) for w in ws]
        if self._prefix.index and self.cfg.prefix_refresh_s > 0:
            self._tasks.append(asyncio.create_task(self._refresh_prefix()))

    async def _refresh_prefix(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.cfg.prefix_refresh_s)
            await self._prefix.refresh(self._everyone(), self._flights, self.cfg.call_timeout_s)

    # ---- workers (polling, losses and recovery: cluster/recovery.py) ---------------------------
    def _uncount_prefill(self, f: Flight) -> None:
        if f.prefill_tokens_counted:
            f.prefill_tokens_counted = False
            f.prefill.queued_tokens -= f.prefill_tokens

    def _end(self, f: Flight, outcome: str) -> None:
        """The flight leaves the router (exactly once, counted in the ledger); workers' holdings are freed."""
        if self._flights.pop(f.wid, None) is None:
            return
        self.ledger.end(outcome)
        self._finals.pop(f.wid, None)
        if self._by_request.get(f.req.request_id) is f:
            del self._by_request[f.req.request_id]
        f.done = True
        self._release(f)
        for w in (f.prefill, f.decode):
            if w is not None:
                w.flights.discard(f.wid)
        if outcome == "completed" and f.decode is not None:  # its cache now holds the output's pages too
            self._prefix.record_output(f.decode, list(f.prompt_ids) + list(f.output_ids))
        if self._wake is not None:
            self._wake.set()

    def _release(self, f: Flight) -> None:
        self._uncount_prefill(f)
        if f.decode is not None and f.decode_open:
            f.decode_open = False
            self._spawn(self._call(f.decode, "abort", f.wid))
        if f.prefill is not None and f.prefill_open:
            f.prefill_open = False
            self._spawn(self._cancel_prefill(f.prefill, f.wid))

    async def _cancel_prefill(self, p: Worker, wid: str) -> None:
        """Cancel `wid` on prefill worker `p`; its decode stream is free once `p` took the cancel (which
        stops the push) or is dead."""
        try:
            await self._call(p, "cancel", wid)
        finally:
            self._free_stream(wid)

    async def _call(self, w: Worker, method: str, *args) -> None:
        """Fire-and-forget cleanup: a dead worker has nothing left to free."""
        if not w.alive:
            return
        try:
            await w.handle.call(method, *args)
        except PdserveError:
            pass

    def _spawn(self, coro) -> None:
        """Run `coro` beside the loop. The set keeps a strong reference (the event loop keeps only weak
        ones) until it ends, so `shutdown` can cancel and await it; its errors are handled inside
        (`_guarded`, `_call`), so one that escapes is a bug and is logged, never silently dropped."""
        if self._closed:  # shut down: closing the workers freed what a cleanup call would have
            coro.close()
            return
        task = asyncio.get_running_loop().create_task(coro)
        self._spawned.add(task)
        task.add_done_callback(self._reap)

    def _reap(self, task: asyncio.Task) -> None:
        self._spawned.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("router task %s failed", task.get_coro(), exc_info=task.exception())
