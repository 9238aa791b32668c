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
    last_seen: float = 0.0  # router clock at the last returned drain (the heartbeat)
    reason: str = ""  # why it was fenced or drained
    since: float = 0.0  # router clock at its last state change

    @property
    def alive(self) -> bool:
        """Polled and may be called (live or draining)."""
        return self.state in (LIVE, DRAINING)

    @property
    def name(self) -> str:
        return self.handle.name

    def free_pages(self) -> int:
        return (self.stats.free_pages if self.stats is not None else 0) - self.pages_claimed


class PoolMembership:
    def __init__(self, pool: str, handles=(), now: float = 0.0):
        self.pool = pool
        self._members: list[Worker] = []
        self.pending = 0  # replacements under way (see the module map)
        for h in handles:
            self.join(h, now)

    # ---- reads ---------------------------------------------------------------------------------
    @property
    def members(self) -> list[Worker]:
        """Every listed member, fenced ones too, in slot order (a copy)."""
        return list(self._members)

    def live(self) -> list[Worker]:
        """Members that are polled and may be called: live and draining."""
        return [w for w in self._members if w.alive]

    def placeable(self) -> list[Worker]:
        """Members that take new work; `AwaitingRestart` or `BackendUnavailableError` when there are none."""
        out = [w for w in self._members if w.state == LIVE]
        if not out:
            if self.pending:
                raise AwaitingRestart(self.pool)
            raise BackendUnavailableError(f"no live {self.pool} worker")
        return out

    def __contains__(self, w: Worker) -> bool:
        return any(m is w for m in self._members)

    # ---- changes -------------------------------------------------------------------------------
    def join(self, handle: WorkerHandle, now: float = 0.0) -> Worker:
        """A new live member (appended)."""
        self._check_name(handle.name, "join")
        w = Worker(handle, self.pool, since=now)
        self._members.append(w)
        return w

    def drain(self, w: Worker, reason: str = "drain", now: float = 0.0) -> None:
        """LIVE -> DRAINING: no new work from now on; it finishes what it holds, then `leave`s."""
        self._expect(w, "drain", (LIVE,), "only a live worker drains")
        w.state, w.reason, w.since = DRAINING, reason, now

    def fence(self, w: Worker, reason: str, now: float = 0.0) -> bool:
        """LIVE/DRAINING -> FENCED (dead to the router); False when it was fenced or gone already."""
        if w.pool != self.pool:
            raise MembershipError(self.pool, w.name, "fence", w.state, f"it belongs to pool {w.pool!r}")
        if not w.alive or w not in self:
            return False
        w.state, w.reason, w.since = FENCED, reason, now
        return True

    def leave(self, w: Worker, now: float = 0.0) -> None:
        """DRAINING (holding no flight) or FENCED -> gone from the pool."""
        self._expect(w, "leave", (DRAINING, FENCED), "drain or fence it first")
        if w.state == DRAINING and w.flights:
            raise MembershipError(self.pool, w.name, "leave", w.state, f"it still holds {len(w.flights)} request(s)")
        self._members.remove(w)
        w.state, w.since = GONE, now

    def replace(self, old: Worker, handle: WorkerHandle, now: float = 0.0) -> Worker:
        """FENCED `old` leaves; a new live member of `handle` takes its slot."""
        self._expect(old, "replace", (FENCED,), "only a fenced worker is replaced")
        self._check_name(handle.name, "replace")
        fresh = Worker(handle, self.pool, since=now)
        self._members[self._members.index(old)] = fresh
        old.state, old.since = GONE, now
        return fresh

    def expect_replacement(self) -> None:
        self.pending += 1

    def replacement_settled(self) -> None:
        """A replacement under way joined or gave up."""
        assert self.pending > 0, self.pool
        self.pending -= 1

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
