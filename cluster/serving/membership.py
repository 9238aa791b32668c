"""Pool membership: which workers a pool has and what each may do -- the one truth the router reads and changes.

One `PoolMembership` per pool ("prefill", "decode" or "colocated"). Admission picks among `placeable()`,
the pollers and stats read `live()`, recovery `fence`s and `replace`s, a resize (later: `pdserve scale`, the
autoscaler) `join`s and `drain`s; nobody else changes a member's state. Pure Python: no clock of its own
(callers pass `now`), no I/O -- closing a fenced worker's handle is the caller's job.

A member (`Worker`, the router's record of one worker) moves through:

    join(handle) -> LIVE --drain--> DRAINING --leave (holds no flight)--> gone
                     |                 |
                     +-----fence-------+--> FENCED --leave--> gone
                                                  \\--replace(handle)--> gone; a new LIVE member in its slot

    LIVE      takes new work; polled; its stats count
    DRAINING  takes no new work; still polled, finishes what it holds, then leaves
    FENCED    dead to the router (killed, hung, crashed): never called again (its late events are dropped);
              what it harmed is recovered elsewhere; it stays listed until replaced or it leaves

A bad transition (draining a fenced worker, leaving while holding flights, replacing a live one, joining a
second live member under a taken name, anything on a worker of another pool) raises `MembershipError`
and changes nothing. `fence` is the one forgiving move: detections race (a poller, a call, the
heartbeat watchdog), so fencing a worker that is already fenced or gone returns False.

Health: `target` is how many members the pool should have live (the spec's replicas; a resize changes
it); the pool is degraded while fewer are LIVE or a replacement is under way, and `health()` says since
when (the router's clock) and why (the reason of the change that degraded it: a fence's, a drain's).

`pending` counts replacements under way (a restarting actor, a fresh one starting): while a pool has no
placeable member but one is coming, `placeable()` raises `AwaitingRestart` and the request waits in the
queue (bounded by its deadline); with none coming it raises `BackendUnavailableError` (503).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from cluster.serving_api import BackendUnavailableError
from engine.errors import PdserveError

LIVE, DRAINING, FENCED, GONE = "live", "draining", "fenced", "gone"


class MembershipError(PdserveError, ValueError):
    """A membership change that the member's state does not allow; nothing changed."""

    def __init__(self, pool: str, worker: str, action: str, state: str, why: str):
        self.pool, self.worker, self.action, self.state = pool, worker, action, state
        super().__init__(f"pool {pool!r}: cannot {action} worker {worker!r} ({state}): {why}")


class AwaitingRestart(Exception):
    """Internal to the router: a pool has no placeable worker but a replacement is under way, so a request
    that needs the pool waits in the queue (bounded by its deadline) instead of failing."""


class WorkerHandle(Protocol):
    name: str
    info: dict  # from the worker at start (decode workers: {"address": KV receiver address})

    async def call(self, method: str, *args) -> Any: ...

    async def drain(self, timeout_s: float) -> tuple[list, Any]: ...

    async def close(self) -> None: ...

    # optional: `async def reincarnation(self) -> WorkerHandle` -- the handle of a restarted incarnation


class Spawner(Protocol):
    """Starts worker processes for the router's pools (Ray: `actors.RayPools`; in-process:
    `worker_loop.LocalPools`). The router asks it for a fresh worker in a lost one's slot and closes it last."""

    async def replace(self, pool: str, old: WorkerHandle) -> WorkerHandle:
        """A ready worker for `old`'s slot; `old`'s process is stopped for good first (it may be hung).
        `BackendUnavailableError` when the new one cannot start."""
        ...

    async def add(self, pool: str) -> WorkerHandle:
        """A ready worker in a new slot of `pool` (a resize up; it names the worker).
        `BackendUnavailableError` when it cannot be placed or started (nothing is left behind then)."""
        ...

    async def remove(self, pool: str, handle: WorkerHandle) -> None:
        """Stop the (drained, closed) worker of `handle` and free its slot (a resize down)."""
        ...

    async def close(self) -> None:
        """Stop every worker it started (the router's shutdown, after closing its members)."""
        ...


@dataclass(eq=False)  # (identity: two records of one name are two members)
class Worker:
    """The router's view of one worker: its handle, state, latest stats and the load the router put on it."""
    handle: WorkerHandle
    pool: str
    stats: Any = None
    state: str = LIVE  # changed only by its `PoolMembership`
    flights: set[str] = field(default_factory=set)  # wids assigned here
    queued_tokens: int = 0  # prefill: prompt tokens submitted, first token not yet back
    pages_claimed: int = 0  # decode: pages reserved since the last stats snapshot
    last_seen: float = 0.0  # router clock at the last returned drain (the heartbeat), or when it joined
    reason: str = ""  # why it was fenced or drained
    since: float = 0.0  # router clock at its last state change
    joined: float = 0.0  # router clock when it joined (a replacement that dies soon after is a crash loop)
    generation: int = 0  # 0: started with the pool; n: the n-th replacement in its slot

    @property
    def alive(self) -> bool:
        """Polled and may be called (live or draining)."""
        return self.state in (LIVE, DRAINING)

    @property
    def name(self) -> str:
        return self.handle.name

    def free_pages(self) -> int:
        return (self.stats.free_pages if self.stats is not None else 0) - self.pages_claimed


@dataclass(frozen=True)
class PoolHealth:
    pool: str
    live: int  # members taking new work
    target: int  # members wanted
    pending: int  # replacements under way
    degraded: bool
    reason: str = ""  # why it became degraded ("" when healthy)
    since: float | None = None  # router clock when it became degraded (None when healthy)


class PoolMembership:
    def __init__(self, pool: str, handles=(), now: float = 0.0):
        self.pool = pool
        self._members: list[Worker] = []
        self.pending = 0  # replacements under way (see the module map)
        self.target = 0
        self._degraded: tuple[str, float] | None = None  # (reason, since) while degraded
        for h in handles:
            self.join(h, now)
        self.target = len(self._members)
        self._touch("", now)

    # ---- reads ---------------------------------------------------------------------------------
    @property
    def members(self) -> list[Worker]:
        """Every listed member, fenced ones too, in slot order (a copy)."""
        return list(self._members)

    def live(self) -> list[Worker]:
        """Members that are polled and may be called: live and draining."""
        return [w for w in self._members if w.alive]

    def placeable_or_empty(self) -> list[Worker]:
        """Members that take new work (maybe none)."""
        return [w for w in self._members if w.state == LIVE]

    def placeable(self) -> list[Worker]:
        """Members that take new work; `AwaitingRestart` or `BackendUnavailableError` when there are none."""
        out = self.placeable_or_empty()
        if not out:
            if self.pending:
                raise AwaitingRestart(self.pool)
            raise BackendUnavailableError(f"no live {self.pool} worker")
        return out

    def __contains__(self, w: Worker) -> bool:
        return any(m is w for m in self._members)

    def health(self) -> PoolHealth:
        live = sum(w.state == LIVE for w in self._members)
        reason, since = self._degraded or ("", None)
        return PoolHealth(self.pool, live, self.target, self.pending, self._degraded is not None, reason, since)

    # ---- changes -------------------------------------------------------------------------------
    def join(self, handle: WorkerHandle, now: float = 0.0) -> Worker:
        """A new live member (appended)."""
        self._check_name(handle.name, "join")
        w = Worker(handle, self.pool, since=now, joined=now, last_seen=now)
        self._members.append(w)
        self._touch("", now)
        return w

    def drain(self, w: Worker, reason: str = "drain", now: float = 0.0) -> None:
        """LIVE -> DRAINING: no new work from now on; it finishes what it holds, then `leave`s."""
        self._expect(w, "drain", (LIVE,), "only a live worker drains")
        w.state, w.reason, w.since = DRAINING, reason, now
        self._touch(f"{w.name} draining: {reason}", now)

    def fence(self, w: Worker, reason: str, now: float = 0.0) -> bool:
        """LIVE/DRAINING -> FENCED (dead to the router); False when it was fenced or gone already."""
        if w.pool != self.pool:
            raise MembershipError(self.pool, w.name, "fence", w.state, f"it belongs to pool {w.pool!r}")
        if not w.alive or w not in self:
            return False
        w.state, w.reason, w.since = FENCED, reason, now
        self._touch(f"{w.name} lost: {reason}", now)
        return True

    def leave(self, w: Worker, now: float = 0.0) -> None:
        """DRAINING (holding no flight) or FENCED -> gone from the pool."""
        self._expect(w, "leave", (DRAINING, FENCED), "drain or fence it first")
        if w.state == DRAINING and w.flights:
            raise MembershipError(self.pool, w.name, "leave", w.state, f"it still holds {len(w.flights)} request(s)")
        self._members.remove(w)
        w.state, w.since = GONE, now
        self._touch(f"{w.name} left", now)

    def replace(self, old: Worker, handle: WorkerHandle, now: float = 0.0) -> Worker:
        """FENCED `old` leaves; a new live member of `handle` takes its slot."""
        self._expect(old, "replace", (FENCED,), "only a fenced worker is replaced")
        self._check_name(handle.name, "replace")
        fresh = Worker(handle, self.pool, since=now, joined=now, last_seen=now, generation=old.generation + 1)
        self._members[self._members.index(old)] = fresh
        old.state, old.since = GONE, now
        self._touch("", now)
        return fresh

    def resize(self, target: int, now: float = 0.0) -> None:
        """The pool should have `target` live members from now on (a resize: joins and drains follow)."""
        assert target >= 1, target
        self.target = target
        self._touch(f"resizing to {target} replica{'s' if target != 1 else ''}", now)

    def expect_replacement(self, now: float = 0.0) -> None:
        self.pending += 1
        self._touch("a replacement is under way", now)

    def replacement_settled(self, now: float = 0.0) -> None:
        """A replacement under way joined or gave up."""
        assert self.pending > 0, self.pool
        self.pending -= 1
        self._touch("", now)

    def _touch(self, reason: str, now: float) -> None:
        """Keep (reason, since) of the current degraded spell: set when it starts, cleared when it ends."""
        live = sum(w.state == LIVE for w in self._members)
        if live >= self.target and not self.pending:
            self._degraded = None
        elif self._degraded is None:
            self._degraded = (reason or f"{live} of {self.target} live", now)

    # ---- checks --------------------------------------------------------------------------------
    def _expect(self, w: Worker, action: str, states: tuple[str, ...], why: str) -> None:
        if w.pool != self.pool:
            raise MembershipError(self.pool, w.name, action, w.state, f"it belongs to pool {w.pool!r}")
        if w not in self:
            raise MembershipError(self.pool, w.name, action, w.state, "it is not a member")
        if w.state not in states:
            raise MembershipError(self.pool, w.name, action, w.state, why)

    def _check_name(self, name: str, action: str) -> None:
        if any(m.name == name and m.alive for m in self._members):
            raise MembershipError(self.pool, name, action, LIVE, "a live member already has that name")
