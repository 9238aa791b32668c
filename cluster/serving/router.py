"""`ClusterRouter`: the `ServingBackend` over pools of workers -- disaggregated or colocated.

Who calls it: the HTTP frontend / Python client through `cluster.serving_api` (`generate`, `abort`,
`stats`, `shutdown`). It talks to workers only through handles with `call(method, *args)`,
`drain(timeout_s)` and `close()`: Ray actors (`actors.py`, whose `start_cluster` builds the router) or
in-process `WorkerLoop`s (`worker_loop.LocalHandle`; unit tests). No Ray import here, and nothing here
imports `actors` (the arrow points the other way).

What it owns (collaborators with explicit state; each gets what it reads and changes passed in):
`pools` (one `PoolMembership` per pool: the live set), `flights` (`FlightTable`), `holdings` (what workers
hold for a flight), `admission` (`Admission`: placement), `recovery` (`Recovery`: pollers, losses,
re-placement, rejoin), `prefix` (`PrefixPlacer`), `tasks` (`Tasks`: what runs beside the callers) and the
`ledger`. This module keeps the request's own life: intake, worker events -> deltas, the end.

Life of a request (disaggregated; docs/design.md "Life of a request"):
  1. `generate()` validates and tokenizes (typed 400s), fixes a seed, checks the queue limit (requests
     without a first token yet; beyond `max_queued_requests` -> `OverloadedError`, 429) and joins the FIFO.
  2. The admission loop (`admission.py`) takes the head: decode worker with the most free pages,
     then the least load; `reserve` there (None = no pages now: the next worker, else wait for capacity);
     then the prefill worker with the fewest queued prefill tokens gets `submit(prompt, descriptor, decode
     address)` from a task beside the loop (the call waits for that worker's current step; it waits
     first for one of the decode worker's `kv_streams_per_decode` receive streams): it prefills and
     ships each layer's KV as computed. With prefix caching (`prefix_routing`, on where the
     workers cache), `prefix_routing.PrefixPlacer` orders both choices by cached prefix against load
     (never a decode worker short of pages), and the reservation's `kv_start` tells the prefill worker
     which KV the decode side already holds.
  3. One poller per worker long-polls `drain()`; events go to their flight's queue. The prefill's first
     token is streamed at once (TTFT); decode deltas follow; `Flight.advance` reconciles the two streams.
  4. The request ends exactly once: finished (decode's last delta, or the prefill's when it stopped at
     its first token), "timeout" at its deadline (request's `deadline_s` or the server default), "abort"
     on `abort()`, or a typed error (a failed transfer under policy "fail", a dead worker). Whatever a
     worker may still hold -- reservation, running request, held prefill pages, transfer -- is freed by
     `abort`/`cancel` on both sides (`holdings.py`), also when the caller stops iterating (client disconnect).
  5. A lost worker (drain or call failed, or no heartbeat within `heartbeat_timeout_s` on the injectable
     `clock`) does not end the requests it harmed: they are re-placed elsewhere and resume where their
     stream stopped (`recovery.py`); the ledger there counts how every admitted request ended.
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
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from cluster.serving.admission import Admission
from cluster.serving.autoscaler import RequestLog
from cluster.serving.flight import Flight, FlightTable, Inbox
from cluster.serving.holdings import PUSH_ENDS, Holdings
from cluster.serving.intake import validate_request
from cluster.serving.membership import PoolMembership, Spawner, Worker, WorkerHandle
from cluster.serving.prefix_routing import PrefixPlacer
from cluster.serving.recovery import Ledger, Recovery, outcome_of
from cluster.serving.scaling import Scaler
from cluster.serving.tasks import Tasks
from cluster.serving_api import (BackendStats, BackendUnavailableError, GenerateDelta, GenerateRequest,
                                 OverloadedError)
from decode_worker.worker import DecodeDelta
from engine.errors import InvalidRequestError, UnknownModelError
from kv_transfer.config import ReceiverConfig
from prefill_worker.worker import PrefillEvent

_TIMEOUT, _ABORT, _FINAL = "timeout", "abort", "final"  # router signals (_FINAL: see `_next_item`)


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
    replace_lost: bool = True  # start a fresh worker in a lost one's slot (where the router has a spawner)
    replace_backoff_s: float = 1.0  # crash loops: the n-th quick death in a row waits this x 2^(n-1)...
    replace_backoff_max_s: float = 60.0  # ...at most this long
    max_replicas: dict = dataclasses.field(default_factory=dict)  # pool -> a resize's upper bound (none: no growth)
    scale_drain_s: float = 30.0  # a worker leaving a pool finishes what it holds this long, then hands off
    prefix_routing: bool | None = None  # route by cached prefix (cluster/prefix_routing.py); None: where workers cache
    prefix_cache_weight: float = 1.0  # one cached prompt token against one queued token
    decode_load_tokens: float = 64.0  # a decode worker's request in flight, in prompt tokens to ship
    prefix_refresh_s: float = 5.0  # replace the prefix index by the workers' reports this often (0: never)
    # pushes open into one decode worker at once: its gRPC server refuses more than max_streams, and a push
    # the router saw end may still hold a server thread for a moment (a client deadline or cancel unwinding)
    kv_streams_per_decode: int = ReceiverConfig.max_streams - 2


class ClusterRouter:
    def __init__(self, config: RouterConfig, pools: dict[str, list[WorkerHandle]], tokenizer,
                 page_size: int = 16, teardown=None, clock: Callable[[], float] = time.monotonic,
                 spawner: Spawner | None = None):
        """`pools`: "prefill" and "decode" handles (disaggregated) or "colocated" ones; `teardown`: an
        async callable run last by `shutdown()`; `clock`: monotonic seconds for deadlines and heartbeats
        (tests inject one); `spawner`: starts fresh workers in lost ones' slots (Ray: `actors.RayPools`,
        which also stops them all at shutdown), None: a lost worker's slot stays empty."""
        self.cfg = config
        self.model_name = config.model_name
        self._tokenizer = tokenizer
        self._teardown = teardown
        self._clock = clock
        self.pools = {pool: PoolMembership(pool, hs, clock()) for pool, hs in pools.items()}
        self.flights = FlightTable()
        self.tasks = Tasks()
        self.ledger = Ledger()
        self.holdings = Holdings(self.tasks, config.kv_streams_per_decode)
        infos = {pool: [(h.name, getattr(h, "info", None)) for h in hs] for pool, hs in pools.items()}
        self.prefix = PrefixPlacer(infos, config.prefix_routing, config.prefix_cache_weight,
                                   config.decode_load_tokens)
        self.spawner = spawner
        self.recovery = Recovery(config, self.pools, self.flights, self.holdings, self.tasks, self.prefix,
                                 self.ledger, tokenizer, clock, spawner)
        self.admission = Admission(config, self.pools, self.flights, self.holdings, self.recovery, self.prefix,
                                   self.tasks, page_size, clock)
        self.scaler = Scaler(config, self.pools, self.flights, self.holdings, self.recovery, self.prefix,
                             self.tasks, spawner, clock)
        self._finals: dict[str, DecodeDelta] = {}  # wid -> decode's last delta, held for the prefill's report
        self.requests = RequestLog()  # the autoscaler's window; `autoscaler`: set by ray_pools when enabled
        self.autoscaler = None
        self._started = False

    @property
    def workers(self) -> dict[str, list[Worker]]:
        """Every pool's listed members (fenced ones too), by pool: a read-only view of `pools`."""
        return {pool: m.members for pool, m in self.pools.items()}

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
        f = self.flights.by_request.get(request_id)
        if f is not None and not f.done:
            f.queue.put_nowait(_ABORT)

    async def stats(self) -> BackendStats:
        self._ensure_started()
        everyone = [w for m in self.pools.values() for w in m.live() if w.stats is not None]
        queued = self.flights.queued()
        extra = {f"{w.name}.{k}": float(v) for w in everyone for k, v in dataclasses.asdict(w.stats).items()
                 if isinstance(v, (int, float))}
        senders = [w.stats for w in everyone if w.pool == "prefill"]  # totals the /metrics gauges read
        extra["kv_transfer_bytes"] = float(sum(s.kv_bytes_sent for s in senders))
        extra["kv_transfer_seconds"] = float(sum(s.kv_transfer_seconds for s in senders))
        extra.update(self.ledger.extra(len(self.flights)))
        extra.update(self.prefix.extra(everyone))
        health = self.health()
        for pool, h in health["pools"].items():
            extra.update({f"pool_{pool}_{k}": float(h[k]) for k in ("live", "target", "pending", "degraded")})
        return BackendStats(queued, len(self.flights) - queued, sum(w.stats.pages_in_use for w in everyone),
                            sum(w.stats.num_pages for w in everyone),
                            sum(w.stats.num_preemptions for w in everyone if w.pool != "prefill"), extra, health,
                            self.autoscaler.status() if self.autoscaler is not None else None)

    def health(self) -> dict[str, Any]:
        """{"status": "ok" | "degraded", "pools": {pool: {live, target, pending, degraded, reason, since}}}:
        a pool is degraded while fewer of its workers are live than it should have or one is being
        replaced; `reason` says why it became so, `since` when (unix seconds)."""
        offset = time.time() - self._clock()  # router clock -> unix time
        pools = {}
        for name, m in self.pools.items():
            h = m.health()
            pools[name] = {"live": h.live, "target": h.target, "pending": h.pending, "degraded": h.degraded,
                           "reason": h.reason, "since": None if h.since is None else h.since + offset}
        return {"status": "degraded" if any(p["degraded"] for p in pools.values()) else "ok", "pools": pools}

    async def scale(self, pool: str, replicas: int) -> dict[str, Any]:
        """Resize `pool` to `replicas` workers while serving (`scaling.py`): {pool, replicas, added, removed};
        `ScaleError` (400) on bad input, with nothing changed."""
        self._ensure_started()
        return await self.scaler.scale(pool, replicas)

    async def worker_stats(self) -> dict[str, Any]:
        """Fresh stats of every live worker, by name (tests: leak checks, preemption counters)."""
        out = {}
        for w in (w for m in self.pools.values() for w in m.live()):
            out[w.name] = await w.handle.call("stats")
        return out

    async def leftovers(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """The live workers still holding pages, reservations, requests or transfers, waiting up to
        `timeout_s` for them to let go (cleanup calls are asynchronous); {} once every worker is empty and
        the router holds no request. Leak checks in tests and benches."""
        end = time.monotonic() + timeout_s
        while True:
            left = {name: s for name, s in (await self.worker_stats()).items()
                    if s.pages_in_use or s.reservations or s.running or s.waiting
                    or getattr(s, "held", 0) or getattr(s, "sending", 0) or getattr(s, "receiving", 0)}
            if not left and not self.flights.by_wid and not self.flights.waiting:
                return {}
            if time.monotonic() > end:
                return left or {"router": f"flights {list(self.flights.by_wid)}, {len(self.flights.waiting)} waiting"}
            await asyncio.sleep(0.05)

    async def shutdown(self) -> None:
        if self.tasks.closed:
            return
        self.tasks.closed = True  # (from now on no cleanup call starts: closing the workers frees it all)
        for f in list(self.flights.by_wid.values()):
            f.queue.put_nowait(BackendUnavailableError("the router is shutting down"))
        await self.tasks.close()
        await asyncio.gather(*(w.handle.close() for m in self.pools.values() for w in m.members),
                             return_exceptions=True)
        if self.spawner is not None:
            await self.spawner.close()
        if self._teardown is not None:
            await self._teardown()

    # ---- intake ------------------------------------------------------------------------------
    def _open(self, req: GenerateRequest) -> Flight:
        if self.tasks.closed:
            raise BackendUnavailableError("the router is shut down")
        if req.model != self.model_name:
            raise UnknownModelError(req.model, f"this server serves {self.model_name!r}")
        prompt_ids, params = validate_request(req, self.cfg, self._tokenizer)
        if req.request_id in self.flights.by_request:
            raise InvalidRequestError("request_id", f"{req.request_id!r} is already in flight")
        queued = self.flights.queued()
        if queued >= self.cfg.max_queued_requests:
            raise OverloadedError(f"{queued} requests are queued (limit {self.cfg.max_queued_requests}); retry later")
        self._ensure_started()
        timeout = req.deadline_s if req.deadline_s is not None else self.cfg.request_timeout_s
        f = Flight(req, self.flights.new_wid(req.request_id), prompt_ids, params, self._clock() + timeout,
                   Inbox(self.holdings.on_arrival))
        f.mark("queued")
        self.ledger.admitted += 1
        self.flights.add(f)
        self.requests.opened(f, self._clock())
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
                self.tasks.spawn(self.recovery.confirm_failure(f, f.wid, item.error))
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
            f.uncount_prefill()
        if ev.kind in PUSH_ENDS:
            f.prefill_open, f.prefill_ended = False, True
            self.holdings.free_stream(f.wid)  # (freed on arrival already, unless it outran the submit's answer)
            if f.wid in self._finals:  # the decode side finished first: the record is complete now
                return self._finish_held(f)
        if ev.kind == "transfer_failed":
            if self.cfg.mode == "disaggregated" and f.decode is not None and f.decode_open:
                self.tasks.spawn(self.holdings.call(f.decode, "fail_transfer", f.wid, ev.reason or "transfer failed"))
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

    # ---- start and end ---------------------------------------------------------------------------
    def _ensure_started(self) -> None:
        """Start the admission loop, a poller per member and the prefix refresh (on first use: they need
        the caller's event loop)."""
        if self._started:
            return
        self._started = True
        self.tasks.start(self.admission.run())
        for m in self.pools.values():
            for w in m.live():
                self.tasks.start(self.recovery.poll(w))
        if self.prefix.index and self.cfg.prefix_refresh_s > 0:
            self.tasks.start(self._refresh_prefix())
        if self.autoscaler is not None:
            self.tasks.start(self.autoscaler.run())

    async def _refresh_prefix(self) -> None:
        while not self.tasks.closed:
            await asyncio.sleep(self.cfg.prefix_refresh_s)
            await self.prefix.refresh(self.recovery.everyone(), self.flights.by_wid, self.cfg.call_timeout_s)

    def _end(self, f: Flight, outcome: str) -> None:
        """The flight leaves the router (exactly once, counted in the ledger); workers' holdings are freed."""
        if not self.flights.remove(f):
            return
        self.ledger.end(outcome)
        self.requests.ended(f, outcome, self._clock())
        self._finals.pop(f.wid, None)
        f.done = True
        self.holdings.release(f)
        for w in (f.prefill, f.decode):
            if w is not None:
                w.flights.discard(f.wid)
        if outcome == "completed" and f.decode is not None:  # its cache now holds the output's pages too
            self.prefix.record_output(f.decode, list(f.prompt_ids) + list(f.output_ids))
