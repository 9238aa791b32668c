"""`Recovery`: the router's worker side -- pollers (heartbeats), worker losses, request recovery, rejoins --
and the `Ledger`. Pure Python, no Ray.

Who calls it: the router owns one (`ClusterRouter.recovery`) and starts a poller per member; admission
sends its placement commands through `ask` and hands it the flights a placement step harmed (`recover`).
What it reads and changes is passed in: the pools' `PoolMembership`s (it fences and replaces members),
the `FlightTable`, `Holdings` (to let go of a harmed flight's old placement), the `Tasks` it runs beside the
loop, the `PrefixPlacer` and the `Ledger`. Order of events when a worker is lost:
  1. Detection: its poller's `drain()` raised (the actor or thread is gone), a call to it raised
     `BackendUnavailableError`, or the watchdog (`check_heartbeats`, run by the admission loop) saw no heartbeat (a returned `drain()`) for
     `RouterConfig.heartbeat_timeout_s` on the router's injectable clock (`stale_workers`): a hung worker
     is declared dead within timeout + one admission tick (50 ms), then fenced (`handle.close()`).
     Placement commands (`reserve`, `submit`, `add_request`) must answer within `call_timeout_s` (`_ask`),
     else their worker is lost and fenced too: a wedged worker stalls admission (and this watchdog, which
     runs on the admission task) for at most that long. (That bound is asyncio time, not the clock.)
  2. Triage (`harmed_by`): a flight is harmed when the dead worker still owed it something -- its decode
     side (reservation or running request), or its prefill side before the KV left (first token or the
     transfer still pending). A prefill worker whose transfer was done no longer matters to the flight.
  3. Recovery (`recover`): a harmed flight that is not done and has recoveries left is
     re-placed like a new request, at the head of the queue, under a fresh worker id (so late events of the
     old placement are ignored), with `resume_plan`: prompt + the tokens already streamed as the new
     prompt, `max_tokens` reduced by as many. The healthy prefill worker recomputes that KV and ships it
     to a healthy decode worker, whose stream then continues where the client's stopped
     (`Flight.rebase`: event counts are offset by the tokens and characters already seen) -- no token
     lost, none repeated. A flight out of recoveries ends with `BackendUnavailableError`.
  4. Rejoin (`RouterConfig.rejoin_restarted`, on when the spec lets Ray restart actors): while a pool has no
     live worker but one is restarting, requests that need it (new ones and recovered ones) wait in the
     queue (`AwaitingRestart`, the pool's `pending` replacement) until it rejoins or their deadline
     passes; a lost worker whose handle has `reincarnation()` (Ray: waits for the restarted actor's
     `ready()`) is replaced by a NEW `Worker` record in its slot once a new incarnation (a random id the
     actor draws at start) answers (`PoolMembership.replace`); the old record is gone and stays dead. The same incarnation (a hung worker that was fenced) or none (dead for good) never returns.
Old incarnations: nothing of a lost placement can land in the new one. The router forgets the old worker id
(late events are dropped by the router), aborts the old reservation on a live decode worker (late chunks of a
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
from dataclasses import dataclass
from typing import Callable

from cluster.serving.flight import Flight, FlightTable
from cluster.serving.holdings import Holdings
from cluster.serving.membership import PoolMembership, Worker
from cluster.serving.prefix_routing import PrefixPlacer
from cluster.serving.tasks import Tasks
from cluster.serving_api import BackendUnavailableError
from engine.sampling_params import SamplingParams

OUTCOMES = ("completed", "failed", "cancelled")


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


class Recovery:
    def __init__(self, cfg, pools: dict[str, PoolMembership], flights: FlightTable, holdings: Holdings,
                 tasks: Tasks, prefix: PrefixPlacer, ledger: Ledger, tokenizer, clock: Callable[[], float]):
        """`cfg`: the router's `RouterConfig` (drain, heartbeat and call timeouts, max_recoveries,
        rejoin_restarted); `tokenizer` detokenizes a resumed stream's seam; `clock`: monotonic seconds."""
        self.cfg, self.pools, self.flights, self.holdings = cfg, pools, flights, holdings
        self.tasks, self.prefix, self.ledger, self.tokenizer, self.clock = tasks, prefix, ledger, tokenizer, clock

    def everyone(self) -> list[Worker]:
        return [w for m in self.pools.values() for w in m.members]

    async def poll(self, w: Worker) -> None:
        """Long-poll one worker's events into their flights; a returned drain is its heartbeat."""
        w.last_seen = self.clock()
        while not self.tasks.closed and w.alive:
            try:
                events, stats = await w.handle.drain(self.cfg.drain_timeout_s)
            except Exception as e:  # noqa: BLE001 - any transport failure means the worker is gone
                self.lose(w, e if isinstance(e, BackendUnavailableError) else BackendUnavailableError(
                    f"worker {w.name} failed: {type(e).__name__}: {e}"))
                return
            if not w.alive:  # declared dead meanwhile (heartbeat): its late events must not count
                return
            w.last_seen = self.clock()
            if stats is not None:
                w.stats, w.pages_claimed = stats, 0
            for ev in events:
                f = self.flights.get(ev.request_id)
                if f is not None:
                    f.queue.put_nowait(ev)
            self.flights.wake.set()

    async def ask(self, w: Worker, method: str, *args):
        """A command to `w` that must answer within `call_timeout_s`; a worker that does not is lost and
        fenced (what it may still do for the command is undone when the fence closes it), one that cannot
        (stopped loop, dead actor) is lost."""
        try:
            return await asyncio.wait_for(w.handle.call(method, *args), self.cfg.call_timeout_s)
        except BackendUnavailableError as e:  # its loop or actor is gone: do not pick it again
            self.lose(w, e)
            raise
        except asyncio.TimeoutError:
            err = BackendUnavailableError(f"worker {w.name}: {method} got no answer within "
                                          f"{self.cfg.call_timeout_s} s")
            self.lose(w, err, close=True)
            raise err from None

    async def confirm_failure(self, f: Flight, wid: str, error: str) -> None:
        """A decode worker failed `f`'s transfer before its prefill worker reported the push's end: if that
        worker is dead (it took the push with it), `f` recovers; otherwise the failure stands."""
        p = f.prefill
        try:
            await self.ask(p, "stats")
        except BackendUnavailableError as e:
            self.lose(p, e)  # (harmed: its prefill had not ended) -> re-queued under a new wid
        if f.wid == wid and not f.done:
            f.queue.put_nowait(BackendUnavailableError(f"request {f.req.request_id}: {error}"))

    def check_heartbeats(self) -> None:
        """Declare silent workers dead and fence them: closing a wedged worker (Ray: killing the actor)
        frees what it holds and keeps a zombie from acting on requests that moved on."""
        for w in stale_workers(self.everyone(), self.clock(), self.cfg.heartbeat_timeout_s):
            self.lose(w, BackendUnavailableError(
                f"worker {w.name}: no heartbeat for {self.cfg.heartbeat_timeout_s} s"), close=True)

    async def _close(self, w: Worker) -> None:
        try:
            await w.handle.close()
        except Exception:  # noqa: BLE001 - it is dead to the router either way
            pass

    def lose(self, w: Worker, err: BackendUnavailableError, close: bool = False) -> None:
        """`w` is dead to the router: fence it (`close`: and stop it), route around it; the flights it
        harmed recover or fail; a restarted incarnation is awaited where the spec lets Ray restart it."""
        pool = self.pools[w.pool]
        if not pool.fence(w, str(err), self.clock()):
            return
        self.ledger.workers_lost += 1
        self.prefix.forget(w)  # a restarted incarnation starts with an empty prefix cache
        self.holdings.forget(w)
        for wid in list(w.flights):
            f = self.flights.get(wid)
            if f is not None and harmed_by(f, w):
                self.recover(f, err)
        if self.cfg.rejoin_restarted and hasattr(w.handle, "reincarnation") and not self.tasks.closed:
            pool.expect_replacement()  # until _rejoin settles
            self.tasks.start(self._rejoin(w))
        if close:
            self.tasks.spawn(self._close(w))
        self.flights.wake.set()

    async def _rejoin(self, w: Worker) -> None:
        """Replace `w` by its restarted actor, if a new incarnation answers. Nothing addressed to the old
        record (its flights, reservations, late events) reaches the new one: the old record is gone, and
        a restarted decode worker draws fresh reservation ids and nonces."""
        pool = self.pools[w.pool]
        try:
            handle = await w.handle.reincarnation()
        except BackendUnavailableError:
            return  # dead for good: out of restarts, or killed without one
        finally:
            pool.replacement_settled()
            self.flights.wake.set()  # requests waiting for this pool: place them, or fail them now
        old = w.handle.info.get("incarnation")
        if self.tasks.closed or handle.info.get("incarnation") in (None, old):
            return  # the same process (fenced while hung) never comes back
        fresh = pool.replace(w, handle, self.clock())
        self.ledger.workers_rejoined += 1
        self.tasks.start(self.poll(fresh))
        self.flights.wake.set()

    def recover(self, f: Flight, err: BackendUnavailableError) -> None:
        """Re-queue `f` at the head under a fresh worker id to resume elsewhere, or fail it with `err`."""
        if f.done or self.flights.get(f.wid) is not f:
            return
        if f.recoveries >= self.cfg.max_recoveries:
            f.queue.put_nowait(BackendUnavailableError(f"{err} (request {f.req.request_id}: "
                                                       f"{f.recoveries} recoveries already)"))
            return
        self.holdings.release(f)
        for w in (f.prefill, f.decode):
            if w is not None:
                w.flights.discard(f.wid)
        plan, seam = resume_plan(f), seam_of(self.tokenizer, f.output_ids)
        self.flights.requeue_first(f, lambda wid: f.rebase(wid, *plan, seam))
        f.mark("recovered")
        self.ledger.recovered += 1
