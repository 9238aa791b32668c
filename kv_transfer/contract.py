"""The KV-transfer contract: descriptors, polled state, typed errors, the source/sink/transport protocols.

Life of a transfer (docs/design.md "Life of a request", steps 3-6):
  1. The decode side's `KVSink.reserve()` holds pages under a lease and returns a `TransferDescriptor`
     (request id, reservation id, nonce, model fingerprint, layout signature, token count, and `kv_start`:
     with prefix caching the decode side already holds the KV of tokens [0, kv_start), so only the rest
     is shipped and the sink refuses chunks below it).
  2. The descriptor travels (router, Ray) to the prefill side, whose `KVSource.send()` streams the KV of
     that request, one layer at a time as the prefill computes it, over a `Transport` to the sink.
  3. The sink validates every frame against the reservation, writes chunks into the reserved pages and,
     once every (layer, head, token) cell and the first token arrived, commits the request to its engine.
Both ends poll `status()`: PENDING -> TRANSFERRING -> DONE | FAILED(reason). Each transfer ends exactly
once; observers passed as `on_end` hear about it once.

Errors carry a grpc-independent `ErrorCode`; the gRPC transport maps them to status codes and back.
Transports register by name in `TRANSPORTS` (the real one beside the in-process fake) and are imported
lazily, so importing this module never imports grpc.
"""
from __future__ import annotations

import enum
import importlib
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Protocol

from engine.errors import PdserveError


class TransferState(str, enum.Enum):
    PENDING = "pending"  # reserved / registered, no frame yet
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (TransferState.DONE, TransferState.FAILED)


class ErrorCode(str, enum.Enum):
    """Failure classes, named after the gRPC status each maps to (but independent of grpc)."""
    INVALID_ARGUMENT = "INVALID_ARGUMENT"  # malformed frame, ranges outside the reservation
    NOT_FOUND = "NOT_FOUND"  # no such reservation
    UNAUTHENTICATED = "UNAUTHENTICATED"  # missing or wrong auth token
    PERMISSION_DENIED = "PERMISSION_DENIED"  # wrong nonce / request binding for a live reservation
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"  # chunk, message or stream over its cap
    DATA_LOSS = "DATA_LOSS"  # checksum or length mismatch
    FAILED_PRECONDITION = "FAILED_PRECONDITION"  # expired/finished reservation, model or layout mismatch
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    CANCELLED = "CANCELLED"
    UNAVAILABLE = "UNAVAILABLE"  # receiver unreachable
    INTERNAL = "INTERNAL"


class TransferError(PdserveError):
    """Base of typed transfer errors. `fatal`: the error ends the transfer it names (False when the
    frame could come from someone who does not own the transfer, e.g. a wrong nonce)."""
    code = ErrorCode.INTERNAL
    fatal = True

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidFrame(TransferError):
    code = ErrorCode.INVALID_ARGUMENT


class UnknownReservation(TransferError):
    code = ErrorCode.NOT_FOUND
    fatal = False


class Unauthenticated(TransferError):
    code = ErrorCode.UNAUTHENTICATED
    fatal = False


class PermissionDenied(TransferError):
    code = ErrorCode.PERMISSION_DENIED
    fatal = False


class ResourceExhausted(TransferError):
    code = ErrorCode.RESOURCE_EXHAUSTED


class DataLoss(TransferError):
    """Checksum or length mismatch: the bytes are not what the sender sent."""
    code = ErrorCode.DATA_LOSS


class FailedPrecondition(TransferError):
    code = ErrorCode.FAILED_PRECONDITION


class DeadlineExceeded(TransferError):
    code = ErrorCode.DEADLINE_EXCEEDED


class Cancelled(TransferError):
    code = ErrorCode.CANCELLED


class Unavailable(TransferError):
    code = ErrorCode.UNAVAILABLE


class InternalError(TransferError):
    code = ErrorCode.INTERNAL


_BY_CODE = {c.code: c for c in (InvalidFrame, UnknownReservation, Unauthenticated, PermissionDenied,
                                 ResourceExhausted, DataLoss, FailedPrecondition, DeadlineExceeded,
                                 Cancelled, Unavailable, InternalError)}


def error_for(code: ErrorCode | str, message: str) -> TransferError:
    """The typed error for a code (what a transport raises on the sending side)."""
    return _BY_CODE.get(ErrorCode(code), InternalError)(message)


class TransferConfigError(PdserveError, ValueError):
    """A transfer endpoint is misconfigured (e.g. binding beyond loopback without an auth token)."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


@dataclass(frozen=True)
class TransferDescriptor:
    """What the decode side hands the prefill side: everything a transfer is bound to."""
    request_id: str  # the request id on the decode side
    reservation_id: str
    nonce: str
    model_fingerprint: str
    layout_signature: str
    num_tokens: int  # prompt tokens whose KV the reservation holds
    # first token whose KV must be shipped: [0, kv_start) sit in cached prefix pages the decode side shared
    # into the reservation (prefix caching); a multiple of its page size, <= num_tokens
    kv_start: int = 0


@dataclass(frozen=True)
class TransferStatus:
    state: TransferState
    reason: str | None = None  # why it failed
    code: ErrorCode | None = None
    bytes: int = 0  # payload bytes sent / accepted
    chunks: int = 0  # distinct chunks sent / accepted
    duplicates: int = 0  # chunks received again (ignored)


@dataclass(frozen=True)
class PushResult:
    """How a push ended on the wire: the receiver holds every byte, validated (else an error is raised)."""
    state: str
    reason: str = ""
    chunks_accepted: int = 0
    duplicates: int = 0
    bytes_accepted: int = 0


EndObserver = Callable[[str, TransferStatus], None]  # (transfer key, final status), called once


class KVSink(Protocol):
    """Receiving side (decode worker). `reserve`, `pump`, `cancel` run on the engine thread;
    `handle_push` runs on transport threads."""

    def reserve(self, num_tokens: int, params=None, request_id: str | None = None,
                lease_s: float = 30.0, token_ids: list[int] | None = None) -> TransferDescriptor: ...

    def handle_push(self, frames: Iterable[bytes], token: str | None) -> PushResult: ...

    def pump(self) -> list[str]: ...

    def status(self, reservation_id: str) -> TransferStatus: ...

    def cancel(self, reservation_id: str, reason: str = "cancelled") -> None: ...


class KVSource(Protocol):
    """Sending side (prefill worker). Every method runs on the engine thread."""

    def send(self, request_id: str, descriptor: TransferDescriptor, address: str) -> None: ...

    def poll(self) -> None: ...

    def status(self, request_id: str) -> TransferStatus: ...

    def cancel(self, request_id: str, reason: str = "cancelled") -> None: ...


class Server(Protocol):
    address: str

    def stop(self, grace_s: float = 0.0) -> None: ...


class Transport(Protocol):
    """Moves frames -- wire bytes of `kv_transfer_pb2.Frame` -- from a sender to a sink's `handle_push`;
    setting the `cancel` event (threading.Event) ends a push early as CANCELLED."""
    name: str

    def serve(self, sink: KVSink, config) -> Server: ...

    def push(self, address: str, frames: Iterator[bytes], config, cancel=None) -> PushResult: ...

    def close(self) -> None: ...


# Transports by name, as "module:Class", imported on first use (the grpc one imports grpc).
TRANSPORTS = {
    "grpc": "kv_transfer.grpc_transport:GrpcTransport",
    "fake": "kv_transfer.fake_transport:FakeTransport",
}


def make_transport(name: str, **kwargs) -> Transport:
    try:
        module, cls = TRANSPORTS[name].split(":")
    except KeyError:
        raise TransferConfigError("transport", f"{name!r} is not one of {sorted(TRANSPORTS)}") from None
    return getattr(importlib.import_module(module), cls)(**kwargs)
