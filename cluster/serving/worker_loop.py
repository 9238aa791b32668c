"""`WorkerLoop`: a worker's step loop on its own thread, and the thread-safe door into it (no Ray here).

Workers (`PrefillWorker`, `DecodeWorker`) are single-threaded plain classes: `has_work()`, `step() ->
events`, `stats()`, `close()` and a few commands. A `WorkerLoop` builds the worker *on its thread* (the
engine, its tensors and its page allocator are only ever touched there) and then repeats:

    apply queued commands (each a method name on an allow-list + args; its result or typed error goes
    back through a `concurrent.futures.Future`) -> if the worker has work: `step()`, publish its events
    and a fresh `stats()` snapshot -> otherwise block on the command queue.

Consumers take events with `drain(timeout_s)` (blocks until there are some; returns them with the latest
stats), or register `on_events` to be woken (the in-process `LocalHandle` wakes an asyncio event). A step
that raises stops the loop: the worker is closed, pending and later calls fail with
`BackendUnavailableError`, and `drain` raises it too, so the router fails that worker's requests.
Step watchdog: a step still running after `step_timeout_s` (a hung kernel, a deadlock, a blocked test
hook) makes `drain` raise `BackendUnavailableError` too, although the loop thread cannot be stopped from
outside: the router then fences the worker and its supervisor replaces the process (Ray: kills the actor).
`drain` answers on the caller's thread, so a hung step never hides behind a healthy-looking long poll.

Who uses it: `actors.py` (one loop per Ray actor; Ray's threads call `call`/`drain`) and
`LocalHandle` below (in-process workers: unit tests, single-process serving).
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import queue
import threading
import time
from typing import Any, Callable

from cluster.serving_api import BackendUnavailableError

_STOP = object()
PREFILL_METHODS = frozenset({"submit", "cancel", "stats", "prefix_hashes"})  # the commands the router sends
DECODE_METHODS = frozenset({"reserve", "add_request", "fail_transfer", "abort", "stats", "prefix_hashes"})


class WorkerLoop:
    def __init__(self, factory: Callable[[], Any], methods: frozenset[str], name: str = "worker",
                 info: Callable[[Any], dict] = lambda w: {}, step_timeout_s: float | None = None):
        """`factory()` builds the worker on the loop thread; `methods`: what `call` may invoke;
        `info(worker)`: what `wait_ready()` returns (e.g. the decode worker's KV address);
        `step_timeout_s`: the step watchdog's bound (None: off)."""
        self.name = name
        self.step_timeout_s = step_timeout_s
        self._step_since: float | None = None  # time.monotonic() when the running step began
        self._methods = methods
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._events: list = []
        self._stats = None
        self._error: str | None = None  # why the loop stopped on its own
        self._stopped = False
        self.on_events: Callable[[], None] | None = None
        self._ready: cf.Future = cf.Future()
        self._thread = threading.Thread(target=self._run, args=(factory, info), name=f"pdserve-{name}", daemon=True)
        self._thread.start()

    # ---- any thread --------------------------------------------------------------------------
    def wait_ready(self, timeout_s: float | None = None) -> dict:
        """Block until the worker is built; its info, or the error its construction raised."""
        return self._ready.result(timeout_s)

    def submit(self, method: str, *args) -> cf.Future:
        fut: cf.Future = cf.Future()
        if method not in self._methods:
            fut.set_exception(AttributeError(f"{self.name}: {method!r} is not a command ({sorted(self._methods)})"))
        elif self._stopped:
            fut.set_exception(BackendUnavailableError(f"worker {self.name} is stopped: {self._error or 'shut down'}"))
        else:
            self._cmds.put((method, args, fut))
        return fut

    def call(self, method: str, *args, timeout_s: float | None = None) -> Any:
        return self.submit(method, *args).result(timeout_s)

    def drain(self, timeout_s: float) -> tuple[list, Any]:
        """Events since the last drain (waiting up to `timeout_s` for one) and the latest stats."""
        with self._cond:
            self._cond.wait_for(lambda: self._events or self._stopped, timeout_s)
            self._check_step()
            events, self._events = self._events, []
            if not events and self._error is not None:
                raise BackendUnavailableError(f"worker {self.name} stopped: {self._error}")
            return events, self._stats

    def stop(self, timeout_s: float = 30.0) -> None:
        """Close the worker (its requests aborted, pages freed) and end the thread."""
        self.request_stop()
        self._thread.join(timeout_s)

    def request_stop(self) -> None:
        """Tell the loop to stop after its current step (without waiting: that step may hang)."""
        self._cmds.put(_STOP)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _check_step(self) -> None:
        since, bound = self._step_since, self.step_timeout_s
        if since is not None and bound is not None and (took := time.monotonic() - since) > bound:
            raise BackendUnavailableError(f"worker {self.name}: a step has run for {took:.1f} s "
                                          f"(watchdog bound {bound:.1f} s): hung")

    # ---- the loop thread ---------------------------------------------------------------------
    def _run(self, factory, info) -> None:
        try:
            worker = factory()
            self._ready.set_result(info(worker))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits for readiness
            self._ready.set_exception(e)
            self._finish(None, f"construction failed: {type(e).__name__}: {e}")
            return
        self._publish([], worker.stats())
        while True:
            if not self._apply(worker, block=not worker.has_work()):
                break
            if not worker.has_work():
                continue
            self._step_since = time.monotonic()
            try:
                events = worker.step()
            except Exception as e:  # noqa: BLE001 - a bug in a step must not hang every caller
                self._finish(worker, f"step failed: {type(e).__name__}: {e}")
                return
            finally:
                self._step_since = None
            self._publish(events, worker.stats())
        self._finish(worker, None)

    def _apply(self, worker, block: bool) -> bool:
        """Run queued commands (waiting for one if `block`); False once told to stop."""
        try:
            cmd = self._cmds.get(timeout=0.25) if block else self._cmds.get_nowait()
        except queue.Empty:
            return True
        ran = False
        while True:
            if cmd is _STOP:
                return False
            method, args, fut = cmd
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(getattr(worker, method)(*args))
                except Exception as e:  # noqa: BLE001 - the caller gets it (typed errors stay typed)
                    fut.set_exception(e)
                ran = True
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
        if ran:
            self._publish([], worker.stats())
        return True

    def _publish(self, events: list, stats) -> None:
        with self._cond:
            self._events.extend(events)
            self._stats = stats
            self._cond.notify_all()
        if events and self.on_events is not None:
            self.on_events()

    def _finish(self, worker, error: str | None) -> None:
        """Stop accepting calls, close the worker, fail what is still queued, wake every drain."""
        self._stopped = True
        if worker is not None:
            try:
                worker.close()
            except Exception as e:  # noqa: BLE001 - report, the loop is ending anyway
                error = error or f"close failed: {type(e).__name__}: {e}"
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
            if cmd is not _STOP and cmd[2].set_running_or_notify_cancel():
                cmd[2].set_exception(BackendUnavailableError(f"worker {self.name} stopped"))
        with self._cond:
            self._error = error or "shut down"
            self._cond.notify_all()
        if self.on_events is not None:
            self.on_events()


class LocalHandle:
    """A worker in this process behind the router's async handle interface (`call`, `drain`, `close`)."""

    def __init__(self, name: str, loop: WorkerLoop, info: dict | None = None):
        self.name = name
        self.loop = loop
        self.info = info if info is not None else loop.wait_ready()
        self._wake: asyncio.Event | None = None
        self._aio: asyncio.AbstractEventLoop | None = None

    async def call(self, method: str, *args) -> Any:
        return await asyncio.wrap_future(self.loop.submit(method, *args))

    async def drain(self, timeout_s: float) -> tuple[list, Any]:
        if self._wake is None:
            self._aio, self._wake = asyncio.get_running_loop(), asyncio.Event()
            self.loop.on_events = self._notify
        try:
            await asyncio.wait_for(self._wake.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass
        self._wake.clear()
        return self.loop.drain(0)

    def _notify(self) -> None:
        try:
            self._aio.call_soon_threadsafe(self._wake.set)
        except RuntimeError:  # the event loop is closed: nobody drains any more
            pass

    async def close(self) -> None:
        await asyncio.to_thread(self.loop.stop)


def worker_info(worker) -> dict:
    """What `wait_ready()` tells the router: the KV receiver address (decode) and, with prefix caching on,
    the engine's page naming (`prefix`: salt, page size, pages) for the router's prefix index."""
    return {"address": getattr(worker, "address", None), "prefix": getattr(worker, "prefix_info", None)}


def start_local(kind: str, name: str, factory: Callable[[], Any], timeout_s: float | None = 300.0,
                step_timeout_s: float | None = None) -> LocalHandle:
    """Build a worker of `kind` ("prefill", "decode", "colocated") on its own thread in this process."""
    methods = PREFILL_METHODS if kind == "prefill" else DECODE_METHODS
    loop = WorkerLoop(factory, methods, name, worker_info, step_timeout_s)
    return LocalHandle(name, loop, loop.wait_ready(timeout_s))


class LocalPools:
    """The router's `Spawner` for in-process pools (unit tests, single-process serving): a fresh worker in
    a lost one's slot is built by that pool's factory on a new thread. A hung worker's thread cannot be
    killed: it is told to stop and left to end on its own (a daemon thread)."""

    def __init__(self, factories: dict[str, Callable[[], Any]], step_timeout_s: float | None = None):
        self.factories, self.step_timeout_s = factories, step_timeout_s
        self.started: list[LocalHandle] = []

    def start(self, pool: str, name: str) -> LocalHandle:
        """A worker of `pool` built now, in this thread (the initial members)."""
        handle = start_local(pool, name, self.factories[pool], step_timeout_s=self.step_timeout_s)
        self.started.append(handle)
        return handle

    async def replace(self, pool: str, old) -> LocalHandle:
        old.loop.request_stop()  # (no join: a hung step would hold it)
        self.started = [h for h in self.started if h is not old]
        return await self._start_async(pool, old.name)

    async def add(self, pool: str) -> LocalHandle:
        taken = [int(h.name.rsplit("-", 1)[1]) for h in self.started if h.name.startswith(f"{pool}-")]
        return await self._start_async(pool, f"{pool}-{max(taken, default=-1) + 1}")

    async def remove(self, pool: str, handle) -> None:
        self.started = [h for h in self.started if h is not handle]
        await handle.close()

    async def _start_async(self, pool: str, name: str) -> LocalHandle:
        try:
            return await asyncio.to_thread(self.start, pool, name)
        except Exception as e:  # noqa: BLE001 - the construction's error, typed for the router
            raise BackendUnavailableError(f"worker {name} failed to start: {type(e).__name__}: {e}") from None

    async def close(self) -> None:
        await asyncio.gather(*(h.close() for h in self.started), return_exceptions=True)
