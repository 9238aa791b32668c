"""Helpers for router tests (in-process workers and Ray): collect a stream, and the cluster leak check."""
from __future__ import annotations

import asyncio
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
        if not left and not router._flights and not router._waiting:
            return stats
        assert time.monotonic() < end, f"workers still hold state: {left}; flights {list(router._flights)}"
        await asyncio.sleep(0.05)
