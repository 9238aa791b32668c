"""`Recovery`: the router's worker side -- pollers (heartbeats), worker losses, request recovery, healing
(a lost worker's slot gets a worker again) -- and the `Ledger`. Pure Python, no Ray.

Who calls it: the router owns one (`ClusterRouter.recovery`) and starts a poller per member; admission
sends its placement commands through `ask` and hands it the flights a placement step harmed (`recover`).
What it reads and changes is passed in: the pools' `PoolMembership`s (it fences and replaces members),
the `FlightTable`, `Holdings` (to let go of a harmed flight's old placement), the `Tasks` it runs beside the
loop, the `PrefixPlacer`, the `Ledger` and the `Spawner` (fresh workers). Order of events when a worker is
lost:
  1. Detection: its poller's `drain()` raised (the actor or thread is gone, or the worker's step watchdog
     saw a step run past its bound: `worker_loop`), a call to it raised `BackendUnavailableError`, or the
     heartbeat watchdog (`check_heartbeats`, run by the admission loop) saw no returned `drain()` for
     `RouterConfig.heartbeat_timeout_s` on the router's injectable clock (`stale_workers`): a hung process
     is declared dead within timeout + one admission tick (50 ms), then closed (`handle.close()`).
     Placement commands (`reserve`, `submit`, `add_request`) must answer within `call_timeout_s` (`ask`),
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
  0. Fencing comes first: `PoolMembership.fence` makes the worker dead to the router (never picked, never
     called, its late events dropped); the watchdogs also close it.
  4. Healing (`_heal`): the slot gets a worker again, as a NEW `Worker` record in the old one's slot
     (`PoolMembership.replace`; the old record is gone and stays dead). Where the spec lets Ray restart
     actors (`RouterConfig.rejoin_restarted`), the restarted actor is taken back once a new incarnation (a
     random id the actor draws at start) answers `reincarnation()`; the same incarnation (a hung worker
     that was fenced) or none (dead for good) never returns. Otherwise, or then, the `Spawner` starts a
     fresh worker there (`RouterConfig.replace_lost`, on by default), with a backoff when replacements
     crash-loop (`_spawn`). Until it settles the pool counts it as pending: requests that need a pool with
     no live worker (new ones and recovered ones) wait in the queue (`AwaitingRestart`) until it joins
     or their deadline passes, then resume on it.
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
import logging
from dataclasses import dataclass
from typing import Callable

from cluster.serving.flight import Flight, FlightTable
from cluster.serving.holdings import Holdings
from cluster.serving.membership import DRAINING, PoolMembership, Spawner, Worker
from cluster.serving.prefix_routing import PrefixPlacer
from cluster.serving.tasks import Tasks
from cluster.serving_api import BackendUnavailableError
from engine.sampling_params import SamplingParams

OUTCOMES = ("completed", "failed", "cancelled")
log = logging.getLogger("pdserve.router")
# A replacement that lived this long is not crash looping even if no work reached it: the router may rank a
# fresh worker last until its stats arrive, and one killed from outside while idle (the OOM killer, an
# operator) must be replaced at once, not after a backoff doubled by each earlier kill.
PROVEN_S = 5.0


@dataclass
class Ledger:
    admitted: int = 0
    completed: int = 0  # finished "stop" / "length"
    failed: int = 0  # typed error or deadline ("timeout")
    cancelled: int = 0  # abort() or the caller stopped iterating (client disconnect)
    recovered: int = 0  # re-placements after a worker loss (a request may count more than once)
    workers_lost: int = 0
    workers_rejoined: int = 0  # restarted incarnations taken back
    workers_replaced: int = 0  # fresh workers started in lost ones' slots

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
    params = dataclasses.replace(f.params, max_tokens=f.params.max_tokens - done,
                                 min_tokens=max(0, f.params.min_tokens - done))
    assert params.max_tokens >= 1, (f.wid, done)  # a flight that produced all its tokens is finished
    return list(f.prompt_ids) + list(f.output_ids), params


def seam_of(tokenizer, before: list[int], skip_special_tokens: bool = True):
    """The text a resumed stream's first token lacks when detokenized alone (a dropped leading space)."""
    before = list(before)

    def seam(first: list[int]) -> str:
        def dec(ids: list[int]) -> str:
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        joined, head, alone = dec(before + first), dec(before), dec(first)
        tail = joined[len(head):] if joined.startswith(head) else alone
        return tail[:len(tail) - len(alone)] if tail.endswith(alone) else ""
    return seam


def stale_workers(workers, now: float, timeout_s: float) -> list:
    """Live workers whose last heartbeat (a returned drain) is older than `timeout_s`."""
    return [w for w in workers if w.alive and now - w.last_seen > timeout_s]


class Recovery:
    def __init__(self, cfg, pools: dict[str, PoolMembership], flights: FlightTable, holdings: Holdings,
                 tasks: Tasks, prefix: PrefixPlacer, ledger: Ledger, tokenizer, clock: Callable[[], float],
                 spawner: Spawner | None = None):
        """`cfg`: the router's `RouterConfig` (drain, heartbeat and call timeouts, max_recoveries,
        rejoin_restarted, replacement and its backoff); `tokenizer` detokenizes a resumed stream's seam;
        `clock`: monotonic seconds; `spawner`: starts fresh workers in lost ones' slots (None: nobody does)."""
        self.cfg, self.pools, self.flights, self.holdings = cfg, pools, flights, holdings
        self.tasks, self.prefix, self.ledger, self.tokenizer, self.clock = tasks, prefix, ledger, tokenizer, clock
        self.spawner = spawner
        self.crash_loops: dict[tuple[str, str], int] = {}  # (pool, slot name) -> quick deaths in a row

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

    async def start_member(self, w: Worker) -> None:
        """A member that joined while serving: its stats at once (admission ranks workers by their free
        pages, and one without stats ranks last until its first long poll returns), then its poller."""
        try:
            w.stats = await asyncio.wait_for(w.handle.call("stats"), self.cfg.call_timeout_s)
        except (BackendUnavailableError, asyncio.TimeoutError):
            pass  # (its poller finds out)
        self.tasks.start(self.poll(w))

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
        harmed recover or fail; its slot is healed (`_heal`)."""
        pool, leaving = self.pools[w.pool], w.state == DRAINING
        if not pool.fence(w, str(err), self.clock()):
            return
        self.ledger.workers_lost += 1
        self.prefix.forget(w)  # a restarted incarnation starts with an empty prefix cache
        self.holdings.forget(w)
        for wid in list(w.flights):
            f = self.flights.get(wid)
            if f is not None and harmed_by(f, w):
                self.recover(f, err)
        if not leaving:  # (a draining worker was leaving anyway: its resize removes it)
            self._heal(w)
        if close:
            self.tasks.spawn(self._close(w))
        self.flights.wake.set()

    # ---- healing: a lost worker's slot gets a worker again --------------------------------------------
    def _heal(self, w: Worker) -> None:
        """Start taking `w`'s slot back: Ray's restart of the same actor where the spec allows restarts
        (`rejoin_restarted`), else (or when that one is dead for good) a fresh worker from the spawner. The
        pool counts the replacement as pending until it settles, so requests that need the pool wait."""
        rejoin = self.cfg.rejoin_restarted and hasattr(w.handle, "reincarnation")
        spawn = self.spawner is not None and self.cfg.replace_lost
        if self.tasks.closed or not (rejoin or spawn):
            return
        self.pools[w.pool].expect_replacement(self.clock())
        self.tasks.start(self._take_back(w, rejoin, spawn))

    async def _take_back(self, w: Worker, rejoin: bool, spawn: bool) -> None:
        """Nothing addressed to the old record (its flights, reservations, late events) reaches the new
        worker: the old record is gone, and a new decode worker draws fresh reservation ids and nonces."""
        pool = self.pools[w.pool]
        try:
            handle, how = (await self._reincarnation(w) if rejoin else None), "workers_rejoined"
            if handle is None and spawn:
                handle, how = await self._spawn(w), "workers_replaced"
            if handle is None or self.tasks.closed:
                return
            if len(pool.placeable_or_empty()) >= pool.target:  # the pool shrank meanwhile: not needed
                pool.leave(w, self.clock())
                await handle.close()
                if self.spawner is not None:
                    await self.spawner.remove(w.pool, handle)
                return
            fresh = pool.replace(w, handle, self.clock())
            setattr(self.ledger, how, getattr(self.ledger, how) + 1)
            await self.start_member(fresh)
        finally:
            pool.replacement_settled(self.clock())
            self.flights.wake.set()  # requests waiting for this pool: place them, or fail them now

    async def _reincarnation(self, w: Worker):
        """The restarted actor's handle, or None: dead for good (out of restarts, killed without one) or the
        same process (fenced while hung: it never comes back)."""
        try:
            handle = await w.handle.reincarnation()
        except BackendUnavailableError:
            return None
        old = w.handle.info.get("incarnation")
        return None if handle.info.get("incarnation") in (None, old) else handle

    async def _spawn(self, w: Worker):
        """A fresh worker for `w`'s slot. Backoff: a replacement that dies before it completed a step and
        within `PROVEN_S` of joining (or fails to start) is a crash loop; the n-th in a row waits
        `replace_backoff_s` x 2^(n-1), at most
        `replace_backoff_max_s`, before the next start. The first replacement of a slot, or one after a
        worker that served (killed, or lost under load), starts at once: healing is not slowed by faults
        that are not the worker's own."""
        key, cfg = (w.pool, w.name), self.cfg
        served = getattr(w.stats, "num_steps", 0) or self.clock() - w.joined >= PROVEN_S
        quick = w.generation > 0 and not served
        n = self.crash_loops[key] = self.crash_loops.get(key, 0) + 1 if quick else 0
        while not self.tasks.closed:
            if n:
                await asyncio.sleep(min(cfg.replace_backoff_s * 2 ** (n - 1), cfg.replace_backoff_max_s))
            try:
                return await self.spawner.replace(w.pool, w.handle)
            except Exception as e:  # noqa: BLE001 - a replacement that cannot start is retried, never fatal
                n = self.crash_loops[key] = n + 1
                log.warning("replacing %s failed (%d in a row): %s: %s", w.name, n, type(e).__name__, e)
        return None

    def recover(self, f: Flight, err: BackendUnavailableError, handoff: bool = False) -> None:
        """Re-queue `f` at the head under a fresh worker id to resume elsewhere, or fail it with `err`.
        `handoff`: a planned move (a draining worker's leftovers), which never counts against
        `max_recoveries`."""
        if f.done or self.flights.get(f.wid) is not f:
            return
        if f.recoveries >= self.cfg.max_recoveries and not handoff:
            f.queue.put_nowait(BackendUnavailableError(f"{err} (request {f.req.request_id}: "
                                                       f"{f.recoveries} recoveries already)"))
            return
        self.holdings.release(f)
        for w in (f.prefill, f.decode):
            if w is not None:
                w.flights.discard(f.wid)
        plan, seam = resume_plan(f), seam_of(self.tokenizer, f.output_ids, f.params.skip_special_tokens)
        self.flights.requeue_first(f, lambda wid: f.rebase(wid, *plan, seam))
        f.mark("recovered")
        self.ledger.recovered += 1
