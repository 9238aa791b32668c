"""`FaultyTransport`: a real transport whose pushes pass through a seeded fault plan, for fault-injection
tests against a real cluster (issue 8: drop, corrupt, duplicate and delay a KV chunk).

Who uses it: tests hand an instance to `ClusterRouter.from_spec(spec, transport=...)`; it travels to the Ray
actors as plain data (the plan and the inner transport's name; the inner transport itself -- channels,
locks -- is built lazily in each process) and the workers use it like any transport: `serve()` is the inner
transport's, `push()` sends the inner transport the frames after the plan has had its way with each chunk
frame (parsed and re-encoded by the codec, so the receiver checks them like any other bytes). It is never
built from a spec and is not in `contract.TRANSPORTS`: a serving cluster cannot be configured into it.

Plan (each probability per chunk frame, drawn in order from one seeded RNG per process):
    {"seed": 0, "drop": 0.0, "corrupt": 0.0, "duplicate": 0.0, "delay": 0.0, "delay_s": 0.0}
drop: the chunk never arrives (the finish frame's chunk count then disagrees); corrupt: its payload is
zeroed (the checksum fails); duplicate: it arrives twice (accepted once); delay: the stream stalls
`delay_s` before it (past the push deadline the call fails with DEADLINE_EXCEEDED).
"""
from __future__ import annotations

import random
import threading
import time
from collections import Counter

from kv_transfer import codec
from kv_transfer.contract import TransferConfigError, make_transport

FAULTS = ("drop", "corrupt", "duplicate", "delay")


class FaultyTransport:
    name = "faulty"

    def __init__(self, plan: dict | None = None, inner: str = "grpc"):
        plan = dict(plan or {})
        unknown = set(plan) - set(FAULTS) - {"seed", "delay_s"}
        if unknown or any(not 0.0 <= float(plan.get(k, 0.0)) <= 1.0 for k in FAULTS):
            raise TransferConfigError("plan", f"keys {sorted(FAULTS)} (probabilities in [0, 1]), seed, delay_s; "
                                              f"got {plan}")
        self.plan, self.inner_name = plan, inner
        self._setup()

    def _setup(self) -> None:
        self._inner = None
        self._rng = random.Random(self.plan.get("seed", 0))
        self._lock = threading.Lock()  # push threads share the RNG and the counters
        self.injected: Counter = Counter()

    # Only the plan crosses process boundaries: each process builds its own inner transport and RNG.
    def __getstate__(self) -> dict:
        return {"plan": self.plan, "inner_name": self.inner_name}

    def __setstate__(self, state: dict) -> None:
        self.plan, self.inner_name = state["plan"], state["inner_name"]
        self._setup()

    def _transport(self):
        with self._lock:
            if self._inner is None:
                self._inner = make_transport(self.inner_name)
            return self._inner

    def serve(self, sink, config):
        return self._transport().serve(sink, config)

    def push(self, address: str, frames, config, cancel: threading.Event | None = None):
        return self._transport().push(address, self._faulty(frames), config, cancel)

    def _pick(self) -> str | None:
        with self._lock:
            roll, edge = self._rng.random(), 0.0
            for fault in FAULTS:
                edge += float(self.plan.get(fault, 0.0))
                if roll < edge:
                    self.injected[fault] += 1
                    return fault
        return None

    def _faulty(self, frames):
        for data in frames:
            frame = codec.parse_frame(bytes(data))
            fault = self._pick() if frame.WhichOneof("kind") == "chunk" else None
            if fault == "drop":
                continue
            if fault == "corrupt":
                frame.chunk.payload = bytes(len(frame.chunk.payload))
                data = frame.SerializeToString()
            if fault == "delay":
                time.sleep(float(self.plan.get("delay_s", 0.0)))
            yield data
            if fault == "duplicate":
                yield data

    def close(self) -> None:
        if self._inner is not None:
            self._inner.close()
