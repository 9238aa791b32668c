"""`FaultyTransport`: a real transport whose pushes pass through a seeded fault plan, for fault-injection
tests against a real cluster (issue 8: drop, corrupt, duplicate and delay a KV chunk).

Who uses it: tests hand an instance to `cluster.serving.ray_pools.start_cluster(spec, transport=...)`; it travels to the Ray
actors as plain data (the plan and the inner transport's name; the inner transport itself -- channels,
locks -- is built lazily in each process) and the workers use it like any transport: `serve()` is the inner
transport's, `push()` sends the inner transport the frames after the plan has had its way with each chunk
frame (parsed and re-encoded by the codec, so the receiver checks them like any other bytes). It is never
built from a spec and is not in `contract.TRANSPORTS`: a serving cluster cannot be configured into it.

Plan (each probability per chunk frame, drawn in order from one seeded RNG per process):
    {"seed": 0, "drop": 0.0, "corrupt": 0.0, "duplicate": 0.0, "delay": 0.0, "delay_s": 0.0,
     "requests": {}, "at_chunk": 0}
`requests` aims faults instead of drawing them: {client request id: fault} hits chunk number `at_chunk` of
that request's first transfer (the id before the router's "#n" suffix; a re-prefill after a recovery is not
hit again), so one cluster can run fault-free, faulted and untouched requests side by side.
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
        unknown = set(plan) - set(FAULTS) - {"seed", "delay_s", "requests", "at_chunk"}
        aimed = dict(plan.get("requests", {}))
        if (unknown or any(not 0.0 <= float(plan.get(k, 0.0)) <= 1.0 for k in FAULTS)
                or not set(aimed.values()) <= set(FAULTS)):
            raise TransferConfigError("plan", f"keys {sorted(FAULTS)} (probabilities in [0, 1]), seed, delay_s, "
                                              f"requests ({{request id: fault}}), at_chunk; got {plan}")
        self.plan, self.inner_name = plan, inner
        self._setup()

    def _setup(self) -> None:
        self._inner = None
        self._rng = random.Random(self.plan.get("seed", 0))
        self._lock = threading.Lock()  # push threads share the RNG and the counters
        self.injected: Counter = Counter()
        self._hit: set[str] = set()  # aimed request ids already faulted (their re-prefills run clean)

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

    def _aim(self, request_id: str) -> str | None:
        """The fault aimed at this transfer's request (its first transfer only), if any."""
        rid = request_id.rsplit("#", 1)[0]
        fault = self.plan.get("requests", {}).get(rid)
        with self._lock:
            if fault is None or rid in self._hit:
                return None
            self._hit.add(rid)
            self.injected[fault] += 1
        return fault

    def _faulty(self, frames):
        aimed, n = None, -1
        for data in frames:
            frame = codec.parse_frame(bytes(data))
            kind, fault = frame.WhichOneof("kind"), None
            if kind == "open":
                aimed = self._aim(frame.open.request_id)
            elif kind == "chunk":
                n += 1
                fault = (aimed if n == int(self.plan.get("at_chunk", 0)) else None) if aimed else self._pick()
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
