"""`ClusterRouter`: the `ServingBackend` over pools of workers -- disaggregated or colocated.

Who calls it: the HTTP frontend / Python client through `cluster.serving_api` (`generate`, `abort`,
`stats`, `shutdown`). It talks to workers only through handles with `call(method, *args)`,
`drain(timeout_s)` and `close()`: Ray actors (`cluster/actors.py`, built by `ClusterRouter.from_spec`) or
in-process `WorkerLoop`s (`cluster.worker_loop.LocalHandle`; unit tests). No Ray import here.

Life of a request (disaggregated; DESIGN.md "Life of a request"):
  1. `generate()` validates and tokenizes (typed 400s), fixes a seed, checks the queue limit (requests
     without a first token yet; beyond `max_queued_requests` -> `OverloadedError`, 429) and joins the FIFO.
  2. The admission task takes the head: decode worker with the most free pages, then the least load;
     `reserve` there (None = no pages now: the next worker, else wait for capacity); then the prefill
     worker with the fewest queued prefill tokens gets `submit(prompt, descriptor, decode address)`:
     it prefills and ships each layer's KV as computed.
  3. One poller per worker long-polls `drain()`; events go to their flight's queue. The prefill's first
     token is streamed at once (TTFT); decode deltas follow; `Flight.advance` reconciles the two streams.
  4. The request ends exactly once: finished (decode's last delta, or the prefill's when it stopped at
     its first token), "timeout" at its deadline (request's `deadline_s` or the server default), "abort"
     on `abort()`, or a typed error (a failed transfer under policy "fail", a dead worker). Whatever a
     worker may still hold -- reservation, running request, held prefill pages, transfer -- is freed by
     `abort`/`cancel` on both sides, also when the caller stops iterating (client disconnect).
Colocated: step 2 is `add_request` on the replica with the least load; every event is a decode delta.
Timelines: the router marks its own events; workers' `times` (prefill, transfer, decode) are folded in.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import random
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Protocol

from cluster.flight import Flight
from cluster.serving_api import (BackendStats, BackendUnavailableError, GenerateDelta, GenerateRequest,
                                 OverloadedError)
from decode_worker.worker import DecodeDelta
from engine.errors import InvalidRequestError, PdserveError, UnknownModelError
from prefill_worker.worker import PrefillEvent

_TIMEOUT, _ABORT = "timeout", "abort"  # router signals in a flight's queue


class WorkerHandle(Protocol):
    name: str
    info: dict  # from the worker at start (decode workers: {"address": KV receiver address})

    async def call(self, method: str, *args) -> Any: ...

    async def drain(self, timeout_s: float) -> tuple[list, Any]: ...

    async def close(self) -> None: ...


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


@dataclass
class Worker:
    """The router's view of one worker: its handle, latest stats and the load the router put on it."""
    handle: WorkerHandle
    pool: str
    stats: Any = None
    alive: bool = True
    flights: set[str] = field(default_factory=set)  # wids assigned here
    queued_tokens: int = 0  # prefill: prompt tokens submitted, first token not yet back
    pages_claimed: int = 0  # decode: pages reserved since the last stats snapshot

    def free_pages(self) -> int:
        return (self.stats.free_pages if self.stats is not None else 0) - self.pages_claimed


class ClusterRouter:
    def __init__(self, config: RouterConfig, pools: dict[str, list[WorkerHandle]], tokenizer,
                 page_size: int = 16, teardown=None):
        """`pools`: "prefill" and "decode" handles (disaggregated) or "colocated" ones; `teardown`: an
        async callable run last by `shutdown()` (Ray: kill actors, remove placement groups)."""
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
        self._spawned: set[asyncio.Task] = set()
        self._closed = False

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
        try:
            while True:
                remaining = f.deadline - time.monotonic()
                try:
                    item = await asyncio.wait_for(f.queue.get(), remaining) if remaining > 0 else _TIMEOUT
                except asyncio.TimeoutError:
                    item = _TIMEOUT
                delta = self._apply(f, item)
                if f.done:  # free before the last yield: a caller may never resume the generator after it
                    self._end(f)
                if delta is not None:
                    yield delta
                if f.done:
                    return
        finally:
            self._end(f)  # normal end, error, timeout, or the caller stopped iterating (disconnect)

    async def abort(self, request_id: str) -> None:
        f = self._by_request.get(request_id)
        if f is not None and not f.done:
            f.queue.put_nowait(_ABORT)

    async def stats(self) -> BackendStats:
        self._ensure_started()
        everyone = [w for ws in self.workers.values() for w in ws if w.stats is not None]
        queued = sum(f.queued for f in self._flights.values())
        extra = {f"{w.handle.name}.{k}": float(v) for w in everyone for k, v in dataclasses.asdict(w.stats).items()
                 if isinstance(v, (int, float))}
        senders = [w.stats for w in everyone if w.pool == "prefill"]  # totals the /metrics gauges read
        extra["kv_transfer_bytes"] = float(sum(s.kv_bytes_sent for s in senders))
        extra["kv_transfer_seconds"] = float(sum(s.kv_transfer_seconds for s in senders))
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
        for t in self._tasks:
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
        prompt_ids, params = self._validate(req)
        if req.request_id in self._by_request:
            raise InvalidRequestError("request_id", f"{req.request_id!r} is already in flight")
        queued = sum(f.queued for f in self._flights.values())
        if queued >= self.cfg.max_queued_requests:
            raise OverloadedError(f"{queued} requests are queued (limit {self.cfg.max_queued_requests}); retry later")
        self._ensure_started()
        timeout = req.deadline_s if req.deadline_s is not None else self.cfg.request_timeout_s
        f = Flight(req, f"{req.request_id}#{next(self._ids)}", prompt_ids, params, time.monotonic() + timeout,
                   asyncio.Queue())
        f.mark("queued")
        self._flights[f.wid] = f
        self._by_request[req.request_id] = f
        self._waiting.append(f)
        self._wake.set()
        return f

    def _validate(self, req: GenerateRequest) -> tuple[list[int], Any]:
        params = dataclasses.replace(req.params)  # never mutate the caller's
        params.validate(self.cfg.vocab_size)
        if params.seed is None:  # both workers (and a recompute) must sample the same tokens
            params.seed = random.getrandbits(63)
        if isinstance(req.prompt, str):
            ids = self._tokenizer.encode(req.prompt)
        elif isinstance(req.prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in req.prompt):
            ids = list(req.prompt)
        else:
            raise InvalidRequestError("prompt", "must be a string or a list of integer token ids")
        if not ids:
            raise InvalidRequestError("prompt", "is empty")
        if any(not 0 <= t < self.cfg.vocab_size for t in ids):
            raise InvalidRequestError("prompt", f"token ids must be in [0, {self.cfg.vocab_size})")
        limit = min(self.cfg.max_model_len, self.cfg.kv_capacity_tokens)
        if len(ids) >= limit or len(ids) + params.max_tokens > limit:
            raise InvalidRequestError("max_tokens", f"prompt ({len(ids)}) + max_tokens ({params.max_tokens}) "
                                                    f"exceeds the {limit}-token limit of this cluster")
        if self.cfg.prefill_capacity_tokens is not None and len(ids) > self.cfg.prefill_capacity_tokens:
            raise InvalidRequestError("prompt", f"{len(ids)} tokens exceed the prefill pool's KV capacity "
                                                f"({self.cfg.prefill_capacity_tokens} tokens)")
        return ids, params

    # ---- events -> deltas --------------------------------------------------------------------
    def _apply(self, f: Flight, item) -> GenerateDelta | None:
        if item == _TIMEOUT or item == _ABORT:
            return f.final(item)
        if isinstance(item, BaseException):
            f.done = True
            raise item
        for event, t in (getattr(item, "times", None) or {}).items():  # worker-side timeline events
            f.timeline.setdefault(event, t)
        if isinstance(item, PrefillEvent):
            return self._on_prefill(f, item)
        assert isinstance(item, DecodeDelta), item
        if item.error is not None:
            f.done = True
            f.decode_open = False  # the decode worker already ended it
            raise BackendUnavailableError(f"request {f.req.request_id}: {item.error}")
        if item.finished:
            f.decode_open = False
        return f.advance(item.new_token_ids, item.num_output, item.new_text, item.text_len, item.logprobs,
                         item.finished, item.finish_reason)

    def _on_prefill(self, f: Flight, ev: PrefillEvent) -> GenerateDelta | None:
        if ev.kind in ("first_token", "finished"):
            self._uncount_prefill(f)
        if ev.kind in ("finished", "transfer_done", "transfer_failed"):
            f.prefill_open, f.prefill_ended = False, True
        if ev.kind == "transfer_failed":
            if self.cfg.mode == "disaggregated" and f.decode is not None and f.decode_open:
                self._spawn(self._call(f.decode, "fail_transfer", f.wid, ev.reason or "transfer failed"))
            return None  # the decode worker applies the failure policy and reports what follows
        if ev.kind in ("first_token", "finished"):
            n = len(ev.token_ids)
            return f.advance(ev.token_ids, n, ev.text, len(ev.text), ev.logprobs, ev.kind == "finished",
                             ev.finish_reason)
        return None

    # ---- admission ---------------------------------------------------------------------------
    def _ensure_started(self) -> None:
        if self._wake is not None:
            return
        self._wake = asyncio.Event()
        self._tasks.append(asyncio.create_task(self._admission()))
        for ws in self.workers.values():
            self._tasks += [asyncio.create_task(self._poll(w)) for w in ws]

    async def _admission(self) -> None:
        """Admit waiting flights in arrival order; when the head cannot be placed, wait for capacity."""
        while not self._closed:
            try:
                await asyncio.wait_for(self._wake.wait(), 0.05)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            while self._waiting:
                f = self._waiting[0]
                if not f.done and not await self._place(f):
                    break
                self._waiting.pop(0)

    async def _place(self, f: Flight) -> bool:
        """Try to start `f` on workers; False when none can take it now. Errors end `f`."""
        try:
            if self.cfg.mode == "colocated":
                return await self._place_colocated(f)
            return await self._place_disaggregated(f)
        except PdserveError as e:
            f.queue.put_nowait(e)
        except Exception as e:  # noqa: BLE001 - a bug here must fail one request, not stop admission
            f.queue.put_nowait(BackendUnavailableError(f"placing {f.req.request_id}: {type(e).__name__}: {e}"))
        return True

    def _alive(self, pool: str) -> list[Worker]:
        live = [w for w in self.workers[pool] if w.alive]
        if not live:
            raise BackendUnavailableError(f"no live {pool} worker")
        return live

    async def _place_disaggregated(self, f: Flight) -> bool:
        need = -(-len(f.prompt_ids) // self._page_size)
        lease = max(f.deadline - time.monotonic(), 0.0) + self.cfg.lease_margin_s
        desc = None
        for w in sorted(self._alive("decode"), key=lambda w: (-w.free_pages(), len(w.flights))):
            if w.stats is not None and w.free_pages() < need:
                continue
            desc = await w.handle.call("reserve", f.wid, f.prompt_ids, f.params, lease)
            if desc is not None:
                break
        if desc is None:
            return False
        w.pages_claimed += need
        if f.done:  # timed out or aborted while reserving: _end already ran without knowing the decode side
            self._spawn(self._call(w, "abort", f.wid))
            return True
        f.decode, f.decode_open = w, True
        w.flights.add(f.wid)
        f.mark("reserved")
        p = min(self._alive("prefill"), key=lambda p: (p.queued_tokens, len(p.flights)))
        f.prefill, f.prefill_tokens_counted = p, True
        p.queued_tokens += len(f.prompt_ids)
        p.flights.add(f.wid)
        await p.handle.call("submit", f.wid, f.prompt_ids, f.params, desc, w.handle.info["address"])
        f.prefill_open = not f.prefill_ended
        f.mark("prefill_submitted")
        if f.done:
            self._release(f)
        return True

    async def _place_colocated(self, f: Flight) -> bool:
        w = min(self._alive("colocated"), key=lambda w: (len(w.flights), -w.free_pages()))
        await w.handle.call("add_request", f.wid, f.prompt_ids, f.params)
        if f.done:
            self._spawn(self._call(w, "abort", f.wid))
            return True
        f.decode, f.decode_open = w, True
        w.flights.add(f.wid)
        f.mark("engine_added")
        return True

    # ---- workers -----------------------------------------------------------------------------
    async def _poll(self, w: Worker) -> None:
        """Long-poll one worker's events into their flights; a dead worker fails its flights."""
        while not self._closed and w.alive:
            try:
                events, stats = await w.handle.drain(self.cfg.drain_timeout_s)
            except Exception as e:  # noqa: BLE001 - any transport failure means the worker is gone
                w.alive = False
                err = e if isinstance(e, BackendUnavailableError) else BackendUnavailableError(
                    f"worker {w.handle.name} failed: {type(e).__name__}: {e}")
                for wid in list(w.flights):
                    if wid in self._flights:
                        self._flights[wid].queue.put_nowait(err)
                return
            if stats is not None:
                w.stats, w.pages_claimed = stats, 0
            for ev in events:
                f = self._flights.get(ev.request_id)
                if f is not None:
                    f.queue.put_nowait(ev)
            self._wake.set()

    def _uncount_prefill(self, f: Flight) -> None:
        if f.prefill_tokens_counted:
            f.prefill_tokens_counted = False
            f.prefill.queued_tokens -= len(f.prompt_ids)

    def _end(self, f: Flight) -> None:
        """The flight leaves the router (exactly once); whatever workers still hold for it is freed."""
        if self._flights.pop(f.wid, None) is None:
            return
        if self._by_request.get(f.req.request_id) is f:
            del self._by_request[f.req.request_id]
        f.done = True
        self._release(f)
        for w in (f.prefill, f.decode):
            if w is not None:
                w.flights.discard(f.wid)
        if self._wake is not None:
            self._wake.set()

    def _release(self, f: Flight) -> None:
        self._uncount_prefill(f)
        if f.decode is not None and f.decode_open:
            f.decode_open = False
            self._spawn(self._call(f.decode, "abort", f.wid))
        if f.prefill is not None and f.prefill_open:
            f.prefill_open = False
            self._spawn(self._call(f.prefill, "cancel", f.wid))

    async def _call(self, w: Worker, method: str, *args) -> None:
        """Fire-and-forget cleanup: a dead worker has nothing left to free."""
        try:
            await w.handle.call(method, *args)
        except PdserveError:
            pass

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._spawned.add(task)
        task.add_done_callback(self._spawned.discard)
