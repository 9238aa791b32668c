"""`Tasks`: what the router runs beside its callers, kept so that `close()` can cancel and await all of it.

Two kinds, both on the router's event loop: loops that live as long as the router (`start`: the admission
loop, one poller per worker, the prefix refresh, waits for restarted workers) and short calls beside the
loop (`spawn`: a prefill submit, cleanup calls). The event loop keeps only weak references to tasks, so
this set holds the strong ones. Errors of spawned calls are handled inside them; one that escapes is a bug
and is logged, never silently dropped. After `close()` nothing new starts (a coroutine handed in then is
closed unrun: closing the workers freed what it would have).
"""
from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("pdserve.router")


class Tasks:
    def __init__(self):
        self.closed = False
        self.loops: set[asyncio.Task] = set()  # (an ended loop leaves the set: a poller of a lost worker)
        self.spawned: set[asyncio.Task] = set()

    def start(self, coro) -> None:
        """A loop that lives until `close()`."""
        if self.closed:
            coro.close()
            return
        task = asyncio.get_running_loop().create_task(coro)
        self.loops.add(task)
        task.add_done_callback(self._reap_loop)

    def spawn(self, coro) -> None:
        """A short call beside the loop; forgotten when it ends."""
        if self.closed:
            coro.close()
            return
        task = asyncio.get_running_loop().create_task(coro)
        self.spawned.add(task)
        task.add_done_callback(self._reap)

    async def close(self) -> None:
        """Cancel and await everything (a submit or cleanup call may wait on a wedged worker)."""
        self.closed = True
        everything = [*self.loops, *self.spawned]
        for t in everything:
            t.cancel()
        await asyncio.gather(*everything, return_exceptions=True)

    def _reap_loop(self, task: asyncio.Task) -> None:
        self.loops.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("router loop %s failed", task.get_coro(), exc_info=task.exception())

    def _reap(self, task: asyncio.Task) -> None:
        self.spawned.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("router task %s failed", task.get_coro(), exc_info=task.exception())
