"""`NullSink`: a push handler that takes each frame's bytes as the transport hands them over and keeps
nothing: no parsing, no checksum, no reservation, no pages. Served by a transport (`serve(NullSink(), config)`)
it measures the bare transport, the floor the real `KVReceiver` is compared with.

Who uses it: bench/kv/kv_transfer_bench.py (the `grpc` row) and bench/gpu/disagg_check.py (bare gRPC beside
the full path). Only `handle_push` of the `KVSink` protocol: nothing reserves or commits through it.
"""
from __future__ import annotations

import time
from typing import Iterable

from kv_transfer.contract import PushResult


class NullSink:
    """Bare transport: count each push's bytes; `t_end` is when the last push ended (`time.monotonic()`)."""

    t_end: float | None = None

    def handle_push(self, frames: Iterable[bytes], token: str | None) -> PushResult:
        n = sum(map(len, frames))
        self.t_end = time.monotonic()
        return PushResult("done", bytes_accepted=n)
