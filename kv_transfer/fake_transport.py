"""`FakeTransport`: the in-process transport registered beside gRPC in `contract.TRANSPORTS` as "fake".

Same contract as `kv_transfer.grpc_transport.GrpcTransport`: `serve(sink, config)` registers a sink under
an address ("fake:N"), `push(address, frames, config, cancel)` delivers the frames (wire bytes) to
that sink's `handle_push` on the caller's thread and returns its `PushResult` or raises its typed error.
The message-size cap applies as on the network, the auth token travels beside the frames as metadata
would, and setting `cancel` ends the push as a cancelled call. A `fault(index, frame) -> [frames]` hook
(on parsed `pb.Frame`s) lets tests drop, duplicate, reorder or corrupt frames in flight.
"""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Callable

from kv_transfer import codec
from kv_transfer.contract import Cancelled, PushResult, ResourceExhausted, Unavailable

Fault = Callable[[int, object], list]  # (frame index, parsed pb.Frame) -> frames that arrive instead


@dataclass
class FakeServer:
    address: str
    transport: "FakeTransport"

    def stop(self, grace_s: float = 0.0) -> None:
        self.transport._unregister(self.address)


class FakeTransport:
    name = "fake"

    def __init__(self, fault: Fault | None = None):
        self.fault = fault
        self._sinks: dict[str, tuple[object, object]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.frames_delivered = 0

    def serve(self, sink, config) -> FakeServer:
        with self._lock:
            address = f"fake:{next(self._ids)}"
            self._sinks[address] = (sink, config)
        return FakeServer(address, self)

    def push(self, address: str, frames, config, cancel=None) -> PushResult:
        with self._lock:
            entry = self._sinks.get(address)
        if entry is None:
            raise Unavailable(f"no receiver at {address}")
        sink, server_config = entry
        cap = min(config.max_message_bytes, server_config.max_message_bytes)
        return sink.handle_push(self._wire(frames, cap, cancel), config.token())

    def _wire(self, frames, cap: int, cancel):
        for i, data in enumerate(frames):
            if cancel is not None and cancel.is_set():
                raise Cancelled("push cancelled by the sender")
            if len(data) > cap:
                raise ResourceExhausted(f"frame of {len(data)} bytes exceeds the {cap}-byte message cap")
            if self.fault is not None:  # tamper on parsed frames, deliver wire bytes again
                arrived = [codec.encode(f) for f in self.fault(i, codec.parse_frame(data))]
            else:
                arrived = [data]
            for d in arrived:
                self.frames_delivered += 1
                yield d

    def close(self) -> None:
        pass

    def _unregister(self, address: str) -> None:
        with self._lock:
            self._sinks.pop(address, None)
