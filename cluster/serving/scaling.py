"""`Scaler`: live resizing of a pool -- `ClusterRouter.scale(pool, replicas)` (what `pdserve scale` and the
admin endpoint call). Pure Python, no Ray: workers come and go through the router's `Spawner`.

    scale(pool, n)   check (a known pool, 1 <= n <= its max, no other resize of it under way, a spawner)
                     -> the pool's target becomes n -> grow: `Spawner.add` a worker per missing replica,
                     each joins the pool and gets a poller; shrink: the newest live members drain
                     (`_retire`) -> a summary {pool, replicas, added, removed}
    _retire(w)       DRAINING: admission gives it no new work; it finishes what it holds for up to
                     `RouterConfig.scale_drain_s` -- a decode (or colocated) worker its running requests, a
                     prefill worker the prompts whose KV has not left yet -- then hands off the rest
                     (`Recovery.recover(handoff=True)`: re-placed elsewhere, resuming where the stream
                     stopped, never counted against max_recoveries); waits (bounded) until the worker
                     reports no request, reservation or transfer left; leaves the pool; is closed (its
                     engine frees every page) and removed by the spawner (Ray: actor killed, its
                     placement group removed). Nothing of it is left behind.

Bad input raises `ScaleError` (an `InvalidRequestError`: HTTP 400 naming the field) before anything
changes. A scale-up whose worker cannot start (Ray cannot place it, its model fails to load) ends with
`BackendUnavailableError`; the workers added before it stay, and the target is what joined.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

from cluster.serving.flight import FlightTable
from cluster.serving.holdings import Holdings
from cluster.serving.membership import PoolMembership, Spawner, Worker
from cluster.serving.prefix_routing import PrefixPlacer
from cluster.serving.recovery import Recovery, harmed_by
from cluster.serving.tasks import Tasks
from cluster.serving_api import BackendUnavailableError
from engine.errors import InvalidRequestError

REQUEST_STATE = ("reservations", "receiving", "running", "waiting", "held", "sending")  # worker stats


class ScaleError(InvalidRequestError):
    """A resize the pool cannot take (`field`: "pool" or "replicas"); nothing changed."""


def holds_nothing(stats) -> bool:
    """No request, reservation (lease) or transfer left on a worker (its stats)."""
    return not any(getattr(stats, k, 0) for k in REQUEST_STATE)


class Scaler:
    def __init__(self, cfg, pools: dict[str, PoolMembership], flights: FlightTable, holdings: Holdings,
                 recovery: Recovery, prefix: PrefixPlacer, tasks: Tasks, spawner: Spawner | None,
                 clock: Callable[[], float]):
        """`cfg`: the router's `RouterConfig` (max_replicas per pool, scale_drain_s)."""
        self.cfg, self.pools, self.flights, self.holdings = cfg, pools, flights, holdings
        self.recovery, self.prefix, self.tasks, self.spawner, self.clock = recovery, prefix, tasks, spawner, clock
        self._busy: set[str] = set()  # pools with a resize under way

    def check(self, pool: str, replicas: Any) -> PoolMembership:
        if pool not in self.pools:
            raise ScaleError("pool", f"{pool!r} is not a pool of this cluster (pools: {', '.join(self.pools)})")
        if isinstance(replicas, bool) or not isinstance(replicas, int):
            raise ScaleError("replicas", f"must be an integer (got {replicas!r})")
        top = self.cfg.max_replicas.get(pool, self.pools[pool].target)
        if not 1 <= replicas <= top:
            raise ScaleError("replicas", f"{replicas} is outside [1, {top}] for pool {pool!r} (its max_replicas "
                                         f"is {top}; a pool keeps at least one worker)")
        if pool in self._busy:
            raise ScaleError("pool", f"a resize of pool {pool!r} is under way; retry when it has ended")
        if self.spawner is None or self.tasks.closed:
            raise ScaleError("pool", "this router cannot start or stop workers (no spawner, or shut down)")
        return self.pools[pool]

    async def scale(self, pool: str, replicas: int) -> dict[str, Any]:
        m = self.check(pool, replicas)
        live = m.placeable_or_empty()
        if replicas < m.target and len(live) < m.target - replicas + 1:
            raise ScaleError("replicas", f"pool {pool!r} has {len(live)} live worker(s) of {m.target}; "
                                         f"retry once it has healed")
        self._busy.add(pool)
        added, removed = [], []
        try:
            before = m.target
            m.resize(replicas, self.clock())
            for _ in range(replicas - before):
                added.append(await self._add(m))
            retiring = sorted(live, key=lambda w: w.joined)[len(live) - max(before - replicas, 0):]
            now = self.clock()
            for w in retiring:  # all at once: from now on none of them gets new work
                m.drain(w, f"resized to {replicas}", now)
            self.flights.wake.set()
            for w in retiring:  # (their drains overlap: one deadline for all)
                await self._retire(m, w, now + self.cfg.scale_drain_s)
            removed = [w.name for w in retiring]
        finally:
            self._busy.discard(pool)
            self.flights.wake.set()
        return {"pool": pool, "replicas": m.target, "added": added, "removed": removed}

    async def _add(self, m: PoolMembership) -> str:
        try:
            handle = await self.spawner.add(m.pool)
        except BaseException:
            m.resize(max(1, len(m.placeable_or_empty()) + m.pending), self.clock())  # what is there stays
            raise
        w = m.join(handle, self.clock())
        await self.recovery.start_member(w)
        return w.name

    async def _retire(self, m: PoolMembership, w: Worker, end: float) -> None:
        """Draining `w` leaves: see the module map."""
        while w.alive and self._owed(w) and self.clock() < end:
            await asyncio.sleep(0.05)
        while True:
            for f in self._owed(w):  # still held at the drain's end: moved elsewhere, resumed there
                self.recovery.recover(f, BackendUnavailableError(f"worker {w.name} is leaving the pool"),
                                      handoff=True)
            w.flights.clear()  # (the flights left only have their finished part: their KV left, their end is theirs)
            if w.alive:
                await self._emptied(w)
            if not w.flights:  # a placement picked `w` before the drain and landed during the awaits: again
                break
        if w in m:  # (draining, or fenced if it died meanwhile: then it was not healed)
            m.leave(w, self.clock())
        self.prefix.forget(w)
        self.holdings.forget(w)
        await w.handle.close()
        await self.spawner.remove(m.pool, w.handle)

    def _owed(self, w: Worker) -> list:
        """Flights `w` still owes something (see `recovery.harmed_by`)."""
        return [f for f in map(self.flights.get, list(w.flights)) if f is not None and harmed_by(f, w)]

    async def _emptied(self, w: Worker, timeout_s: float = 10.0) -> None:
        """Wait until `w` reports no request, reservation or transfer (the cleanup calls of what it finished
        or handed off run beside the loop); past `timeout_s` its close frees what is left."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            try:
                if holds_nothing(await w.handle.call("stats")):
                    return
            except Exception:  # noqa: BLE001 - a worker that died while draining holds nothing any more
                return
            await asyncio.sleep(0.05)
