"""Helpers for router tests (in-process workers and Ray): collect a stream, the cluster leak check, and
serving a backend over HTTP on the test's own event loop."""
from __future__ import annotations

import asyncio
import contextlib
import socket
import time

from cluster.serving_api import GenerateRequest


async def collect(router, rid, prompt, params, model, **kw):
    """(token ids streamed, the deltas) of one request; each token must appear once."""
    deltas = [d async for d in router.generate(GenerateRequest(rid, prompt, params, model=model, **kw))]
    assert deltas and deltas[-1].finished and sum(d.finished for d in deltas) == 1
    return [t for d in deltas for t in d.new_token_ids], deltas


async def assert_cluster_empty(router, timeout_s: float = 10.0) -> dict:
    """Every worker: no pages, reservations, requests or transfers left (cleanup calls are asynchronous,
    so this waits up to `timeout_s`); the router holds no request. Returns the workers' final stats."""
    end = time.monotonic() + timeout_s
    while True:
        stats = await router.worker_stats()
        left = {name: s for name, s in stats.items()
                if s.pages_in_use or s.reservations or s.running or s.waiting
                or getattr(s, "held", 0) or getattr(s, "sending", 0) or getattr(s, "receiving", 0)}
        if not left and not router.flights.by_wid and not router.flights.waiting:
            return stats
        assert time.monotonic() < end, f"workers still hold state: {left}; flights {list(router.flights.by_wid)}"
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def serving(backend, max_body_bytes: int = 1 << 20):
    """uvicorn for `backend` on this event loop (127.0.0.1, a free port); yields the base URL. Running on
    the caller's loop lets a test drive the router (leak checks, shutdown) between HTTP calls."""
    import uvicorn

    from cluster.server import _config

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(_config(backend, "127.0.0.1", 0, None, max_body_bytes, "warning"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            assert not task.done(), task.exception()
            await asyncio.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
        sock.close()
