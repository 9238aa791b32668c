"""The router's worker side: worker records, heartbeats, request recovery and the ledger. Pure Python.

Who calls it: `cluster/router.py` only (`ClusterRouter` takes `RecoveryMixin`'s pollers, `_lose` and
`_recover`; `Worker` is its record of one worker). Order of events when a worker is lost:
  1. Detection: its poller's `drain()` raised (the actor or thread is gone), a call to it raised
     `BackendUnavailableError`, or the router's watchdog saw no heartbeat (a returned `drain()`) for
     `RouterConfig.heartbeat_timeout_s` on the router's injectable clock (`stale_workers`): a hung worker
     is declared dead within timeout + one admission tick (50 ms), then fenced (`handle.close()`).
     Placement commands (`reserve`, `submit`, `add_request`) must answer within `call_timeout_s` (`_ask`),
     else their worker is lost and fenced too: a wedged worker stalls admission (and this watchdog, which
     runs on the admission task) for at most that long. (That bound is asyncio time, not the clock.)
  2. Triage (`harmed_by`): a flight is harmed when the dead worker still owed it something -- its decode
     side (reservation or running request), or its prefill side before the KV left (first token or the
     transfer still pending). A prefill worker whose transfer was done no longer matters to the flight.
  3. Recovery (`ClusterRouter._recover`): a harmed flight that is not done and has recoveries left is
     re-placed like a new request, at the head of the queue, under a fresh worker id (so late events of the
     old placement are ignored), with `resume_plan`: prompt + the tokens already streamed as the new
     prompt, `max_tokens` reduced by as many. The healthy prefill worker recomputes that KV and ships it
     to a healthy decode worker, whose stream then continues where the client's stopped
     (`Flight.rebase`: event counts are offset by the tokens and characters already seen) -- no token
     lost, none repeated. A flight out of recoveries ends with `BackendUnavailableError`.
  4. Rejoin (`RouterConfig.rejoin_restarted`, on when the spec lets Ray restart actors): while a pool has no
     live worker but one is restarting, requests that need it (new ones and recovered ones) wait in the
     queue (`AwaitingRestart`) until it rejoins or their deadline passes; a lost worker whose
     handle has `reincarnation()` (Ray: waits for the restarted actor's `ready()`) comes back as a NEW
     `Worker` record once a new incarnation (a random id the actor draws at start) answers; the old record
     stays dead. The same incarnation (a hung worker that was fenced) or none (dead for good) never returns.
Old incarnations: nothing of a lost placement can land in the new one. The router forgets the old worker id
(late events are dropped in `_apply`), aborts the old reservation on a live decode worker (late chunks of a
zombie prefill then hit a finished reservation: FAILED_PRECONDITION, never written), and a restarted decode
worker issues fresh random reservation ids and nonces (an old descriptor is NOT_FOUND or PERMISSION_DENIED
there). No epoch field is needed on the wire for that; a restarted actor on the same address is covered by
the random ids, not by the address.
Exactness: greedy requests resume token-identical (the recompute sees the same tokens). Sampled requests
resume with a valid continuation but not the fault-free one: the sampler keys noise by (seed, output index)
and the resumed request's output index restarts at 0; presence/frequency penalties likewise only see the
tokens generated after the resume. A stop string straddling the resume point is not seen.

The ledger counts every request the router accepted exactly once: admitted == completed + failed +
cancelled + in flight (`Ledger.balanced`); `extra()` feeds `BackendStats.extra` (and so /metrics).
"""
from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Protocol

from cluster.serving_api import BackendUnavailableError
from engine.sampling_params import SamplingParams

OUTCOMES = ("completed", "failed", "cancelled")


class AwaitingRestart(Exception):
    """Internal to the router: every worker of a pool is lost and one of them is being restarted, so a
    request that needs the pool waits in the queue (bounded by its deadline) instead of failing."""


class WorkerHandle(Protocol):
    name: str
    info: dict  # from the worker at start (decode workers: {"address": KV receiver address})

    async def call(self, method: str, *args) -> Any: ...

    async def drain(self, timeout_s: float) -> tuple[list, Any]: ...

    async def close(self) -> None: ...

    # optional: `async def reincarnation(self) -> WorkerHandle` -- the handle of a restarted incarnation


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
    last_seen: float = 0.0  # router clock at the last returned drain (the heartbeat)

    def free_pages(self) -> int:
        return (self.stats.free_pages if self.stats is not None else 0) - self.pages_claimed


@dataclass
class Ledger:
    admitted: int = 0
    completed: int = 0  # finished "stop" / "length"
    failed: int = 0  # typed error or deadline ("timeout")
    cancelled: int = 0  # abort() or the caller stopped iterating (client disconnect)
    recovered: int = 0  # re-placements after a worker loss (a request may count more than once)
    workers_lost: int = 0
    workers_rejoined: int = 0  # restarted incarnations taken back

    def end(self, outcome: str) -> None:
        assert outcome in OUTCOMES, outcome
        setattr(self, outcome, getattr(self, outcome) + 1)

    def balanced(self, in_flight: int) -> bool:
        return self.admitted == self.completed + self.failed + self.cancelled + in_flight

    def extra(self, in_flight: int) -> dict[str, float]:
        out = {(k if k.startswith("workers_") else f"requests_{k}"): float(v)
               for k, v in dataclasses.asdict(self).items()}
        out["requests_in_flight"] = float(in_flight)
        return out


def outcome_of(finish_reason: str | None) -> str:
    """The ledger column of a request that ended with a final delta."""
    if finish_reason == "abort":
        return "cancelled"
    if finish_reason in ("timeout", "error"):
        return "failed"
    return "completed"


def harmed_by(f, w) -> bool:
    """Did losing worker record `w` cost flight `f` something it still needed?"""
    if f.done:
        return False
    if f.decode is w and (f.decode_open or f.prefill is None):  # (colocated: the decode side is everything)
        return True
    return f.prefill is w and not f.prefill_ended


def resume_plan(f) -> tuple[list[int], SamplingParams]:
    """What to run elsewhere: the prompt plus what was streamed, for the tokens still owed."""
    done = len(f.output_ids)
    params = dataclasses.replace(f.params, max_tokens=f.params.max_tokens - done)
    assert params.max_tokens >= 1, (f.wid, done)  # a flight that produced all its tokens is finished
    return list(f.prompt_ids) + list(f.output_ids), params


def seam_of(tokenizer, before: list[int]):
    """The text a resumed stream's first token lacks when detokenized alone (a dropped leading space)."""
    before = list(before)

    def seam(first: list[int]) -> str:
        joined, head, alone = tokenizer.decode(before + first), tokenizer.decode(before), tokenizer.decode(first)
        tail = joined[len(head):] if joined.startswith(head) else alone
        return tail[:len(tail) - len(alone)] if tail.endswith(alone) else ""
    return seam


def stale_workers(workers, now: float, timeout_s: float) -> list:
    """Live workers whose last heartbeat (a returned drain) is older than `timeout_s`."""
    return [w for w in workers if w.alive and now - w.last_seen > timeout_s]


class RecoveryMixin:
    """`ClusterRouter`'s worker side: the pollers (heartbeats), losses and recoveries. Uses the router's
    `cfg`, `workers`, `_flights`, `_waiting`, `_ids`, `_wake`, `_clock`, `_tokenizer`, `ledger`,
    `_release`, `_prefix`."""

    async def _poll(self, w: Worker) -> None:
        """Long-poll one worker's events into their flights; a returned drain is its heartbeat."""
        w.last_seen = self._clock()
        while not self._closed and w.alive:
            try:
                events, stats = await w.handle.drain(self.cfg.drain_timeout_s)
            except Exception as e:  # noqa: BLE001 - any transport failure means the worker is gone
                self._lose(w, e if isinstance(e, BackendUnavailableError) else BackendUnavailableError(
                    f"worker {w.handle.name} failed: {type(e).__name__}: {e}"))
                return
            if not w.alive:  # declared dead meanwhile (heartbeat): its late events must not count
                return
            w.last_seen = self._clock()
            if stats is not None:
                w.stats, w.pages_claimed = stats, 0
            for ev in events:
                f = self._flights.get(ev.request_id)
                if f is not None:
                    f.queue.put_nowait(ev)
            self._wake.set()

    def _everyone(self) -> list[Worker]:
        return [w for ws in self.workers.values() for w in ws]

    async def _ask(self, w: Worker, method: str, *args):
        """A command to `w` that must answer within `call_timeout_s`; a worker that does not is lost and
        fenced (what it may still do for the command is undone when the fence closes it), one that cannot
        (stopped loop, dead actor) is lost."""
        try:
            return await asyncio.wait_for(w.handle.call(method, *args), self.cfg.call_timeout_s)
        except BackendUnavailableError as e:  # its loop or actor is gone: do not pick it again
            self._lose(w, e)
            raise
        except asyncio.TimeoutError:
            err = BackendUnavailableError(f"worker {w.handle.name}: {method} got no answer within "
                                          f"{self.cfg.call_timeout_s} s")
            self._lose(w, err)
            self._spawn(self._fence(w))
            raise err from None

    async def _confirm_failure(self, f, wid: str, error: str) -> None:
        """A decode worker failed `f`'s transfer before its prefill worker reported the push's end: if that
        worker is dead (it took the push with it), `f` recovers; otherwise the failure stands."""
        p = f.prefill
        try:
            await self._ask(p, "stats")
        except BackendUnavailableError as e:
            self._lose(p, e)  # (harmed: its prefill had not ended) -> re-queued under a new wid
        if f.wid == wid and not f.done:
            f.queue.put_nowait(BackendUnavailableError(f"request {f.req.request_id}: {error}"))

    def _check_heartbeats(self) -> None:
        """Declare silent workers dead and fence them: closing a wedged worker (Ray: killing the actor)
        frees what it holds and keeps a zombie from acting on requests that moved on."""
        for w in stale_workers(self._everyone(), self._clock(), self.cfg.heartbeat_timeout_s):
            self._lose(w, BackendUnavailableError(
                f"worker {w.handle.name}: no heartbeat for {self.cfg.heartbeat_timeout_s} s"))
            self._spawn(self._fence(w))

    async def _fence(self, w: Worker) -> None:
        try:
            await w.handle.close()
        except Exception:  # noqa: BLE001 - it is dead to the router either way
            pass

    def _lose(self, w: Worker, err: BackendUnavailableError) -> None:
        """`w` is dead to the router: route around it; the flights it harmed recover or fail."""
        if not w.alive:
            return
        w.alive = False
        self.ledger.workers_lost += 1
        self._prefix.forget(w)  # a restarted incarnation starts with an empty prefix cache
        for wid in list(w.flights):
            f = self._flights.get(wid)
            if f is not None and harmed_by(f, w):
                self._recover(f, err)
        if self.cfg.rejoin_restarted and hasattr(w.handle, "reincarnation") and not self._closed:
            self._restarting[w.pool] = self._restarting.get(w.pool, 0) + 1  # until _rejoin settles
            self._tasks.append(asyncio.get_running_loop().create_task(self._rejoin(w)))  # (cancelled at shutdown)
        if self._wake is not None:
            self._wake.set()

    async def _rejoin(self, w: Worker) -> None:
        """Take back `w`'s restarted actor as a new worker record, if a new incarnation answers. Nothing
        addressed to the old record (its flights, reservations, late events) reaches the new one: the old
        record stays dead, and a restarted decode worker draws fresh reservation ids and nonces."""
        try:
            handle = await w.handle.reincarnation()
        except BackendUnavailableError:
            return  # dead for good: out of restarts, or killed without one
        finally:
            self._restarting[w.pool] -= 1
            if self._wake is not None:
                self._wake.set()  # requests waiting for this pool: place them, or fail them now
        old = w.handle.info.get("incarnation")
        if self._closed or handle.info.get("incarnation") in (None, old):
            return  # the same process (fenced while hung) never comes back
        fresh = Worker(handle, w.pool)
        self.workers[w.pool].append(fresh)
        self.ledger.workers_rejoined += 1
        if self._wake is not None:
            self._tasks.append(asyncio.get_running_loop().create_task(self._poll(fresh)))
            self._wake.set()

    def _recover(self, f, err: BackendUnavailableError) -> None:
        """Re-queue `f` at the head under a fresh worker id to resume elsewhere, or fail it with `err`."""
        if f.done or f.wid not in self._flights:
            return
        if f.recoveries >= self.cfg.max_recoveries:
            f.queue.put_nowait(BackendUnavailableError(f"{err} (request {f.req.request_id}: "
                                                       f"{f.recoveries} recoveries already)"))
            return
        self._release(f)
        for w in (f.prefill, f.decode):
            if w is not None:
                w.flights.discard(f.wid)
        del self._flights[f.wid]
        f.rebase(f"{f.req.request_id}#{next(self._ids)}", *resume_plan(f), seam_of(self._tokenizer, f.output_ids))
        self._flights[f.wid] = f
        f.mark("recovered")
        self.ledger.recovered += 1
        if f in self._waiting:
            self._waiting.remove(f)
        self._waiting.insert(0, f)
        if self._wake is not None:
            self._wake.set()
