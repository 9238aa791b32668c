"""`KVReceiver`: the `KVSink` of a decode engine -- reserve pages, admit pushes, write chunks, commit.

Order of use (engine thread unless noted):
    rx = KVReceiver(llm, ReceiverConfig());  address = rx.serve(make_transport("grpc"))
    desc = rx.reserve(num_tokens, params)      # pages held under a lease; desc goes to the prefill side
    ... transport threads call rx.handle_push(frames, token) for each incoming stream ...
    rx.step()                                  # = rx.pump() then llm.step(), in the decode loop
    rx.status(desc.reservation_id)             # pending / transferring / done / failed(reason)

Threading: the engine is single-threaded, so transport threads never touch engine tensors or the page
allocator. They authenticate, admit the stream against the reservation (nonce, model fingerprint,
layout signature), check every chunk's counts and sizes, verify its checksum, record its cells, and
queue it. `pump()`, on the engine thread, first expires leases and frees the pages of failed transfers
(so a chunk queued for a lapsed reservation is dropped, never written), then writes queued chunks into
the reserved pages (token range -> slots of this engine's page size), then commits every transfer whose
cells and first token are all in through `LLM.add_prefilled_request`. A `threading.RLock` guards the
transfer records; it is never held while tensors are written.
"""
from __future__ import annotations

import hmac
import threading
from collections import OrderedDict, deque

from engine.errors import InvalidRequestError, ReservationError
from engine.kv_cache.page_io import import_kv, slot_runs, stored_token_head_bytes
from kv_transfer import codec
from kv_transfer.config import ReceiverConfig, check_bind, check_token
from kv_transfer.contract import (Cancelled, DataLoss, EndObserver, ErrorCode, FailedPrecondition,
                                  InvalidFrame, PermissionDenied, PushResult, ResourceExhausted,
                                  TransferDescriptor, TransferError, TransferState, TransferStatus,
                                  UnknownReservation)
from kv_transfer.inbound import Inbound


def _not_fatal(err: TransferError) -> TransferError:
    err.fatal = False  # about a transfer that already ended, or one the caller does not own
    return err


class KVReceiver:
    def __init__(self, llm, config: ReceiverConfig | None = None, on_end: EndObserver | None = None,
                 remember_ended: int = 4096):
        self.llm = llm
        self.config = config or ReceiverConfig()
        self.on_end = on_end
        self.layout = codec.TransferLayout.from_spec(llm.kv_spec, stored_token_head_bytes(llm.kv_spec))
        self.clock = llm.allocator.clock  # leases and deadlines read the engine's (injectable) clock
        self._token = self.config.token()
        self._lock = threading.RLock()
        self._live: dict[str, Inbound] = {}  # reservation id -> transfer (failed ones until pump frees them)
        self._ended: OrderedDict[str, TransferStatus] = OrderedDict()
        self._remember = remember_ended
        self._writes: deque[tuple[Inbound, codec.ChunkHeader, memoryview]] = deque()
        self._work = threading.Event()  # set when pump() has something to do (queued chunk, finish, failure)
        self.server = None

    # ---- engine thread -----------------------------------------------------------------------
    def serve(self, transport) -> str:
        """Start receiving on `transport`; refuses a non-loopback bind without a token. Returns the address."""
        check_bind(self.config.host, self._token)
        self.server = transport.serve(self, self.config)
        return self.server.address

    def reserve(self, num_tokens: int, params=None, request_id: str | None = None,
                lease_s: float = 30.0) -> TransferDescriptor:
        """Hold pages for `num_tokens` of incoming KV (OutOfPagesError if none) and describe the transfer."""
        if num_tokens < 1:
            raise InvalidFrame(f"cannot reserve for {num_tokens} tokens")
        res = self.llm.reserve(num_tokens, lease_s)
        desc = TransferDescriptor(request_id or f"kv-{res.reservation_id}", res.reservation_id, res.nonce,
                                  self.llm.fingerprint, self.llm.kv_spec.signature(), num_tokens)
        cap = int(self.layout.transfer_bytes(num_tokens) * self.config.stream_bytes_factor)
        ib = Inbound(desc, self.layout, list(res.pages), params, res.expires_at,
                     cap + self.config.max_chunk_bytes)
        with self._lock:
            self._live[res.reservation_id] = ib
        return desc

    def wait_for_work(self, timeout_s: float) -> bool:
        """For an idle decode loop: block until a transport thread gives pump() work (True) or timeout."""
        return self._work.wait(timeout_s)

    def pump(self) -> list[str]:
        """Expire, free failed transfers' pages, write queued chunks, commit ready transfers; returns the
        request ids that joined the engine."""
        self.llm.allocator.expire()
        with self._lock:
            self._work.clear()
            for rid, ib in self._live.items():
                why = self.llm.allocator.finished_reason(rid)
                if why is not None:
                    self._end(ib, TransferState.FAILED, f"reservation {why}", ErrorCode.FAILED_PRECONDITION)
            writes = self._take_writes()
            if self._writes:  # over the per-pump budget: more next time
                self._work.set()
        self._free_failed()
        for ib, h, payload in writes:
            runs = slot_runs(ib.pages, self.llm.kv_spec.page_size, h.token_start, h.token_end)
            import_kv(self.llm.backend, h.layer, runs, payload, h.head_start - self.layout.head_start,
                      h.head_end - self.layout.head_start)
        with self._lock:
            for ib, _, _ in writes:
                ib.pending_writes -= 1
            ready = [ib for ib in self._live.values() if ib.ready]
        return [rid for rid in map(self._commit, ready) if rid is not None]

    def step(self):
        """One decode-loop iteration: pump, then one engine step (its outputs)."""
        self.pump()
        return self.llm.step()

    def cancel(self, reservation_id: str, reason: str = "cancelled") -> None:
        with self._lock:
            ib = self._live.get(reservation_id)
            if ib is not None:
                self._end(ib, TransferState.FAILED, reason, ErrorCode.CANCELLED)
        self._free_failed()

    def close(self) -> None:
        """Stop serving, fail every live transfer and free its pages."""
        if self.server is not None:
            self.server.stop()
            self.server = None
        for rid in list(self._live):
            self.cancel(rid, "receiver closed")

    # ---- transport threads -------------------------------------------------------------------
    def handle_push(self, frames, token: str | None) -> PushResult:
        """One push stream of wire frames: open, chunks, finish. Raises a typed error; fatal ones fail
        the transfer."""
        check_token(self._token, token)
        it = map(codec.parse_wire, frames)
        first, _ = next(it, (None, None))
        if first is None or first.WhichOneof("kind") != "open":
            raise InvalidFrame("a push must start with an open frame")
        ib = self._admit(first.open)
        try:
            codec.check_layout(first.open, self.layout, self.llm.kv_spec.num_kv_heads)
            codec.check_binding(first.open, self.llm.fingerprint, self.llm.kv_spec.signature(),
                                ib.desc.num_tokens)
            with self._lock:
                self._check_live(ib)
                ib.prompt = list(first.open.prompt_token_ids)
                if ib.state == TransferState.PENDING:
                    ib.state = TransferState.TRANSFERRING
            for frame, payload in it:
                kind = frame.WhichOneof("kind")
                if kind == "chunk":
                    self._accept_chunk(ib, frame.chunk, payload)
                elif kind == "finish":
                    return self._accept_finish(ib, frame.finish)
                else:
                    raise InvalidFrame(f"unexpected {kind} frame after the open frame")
            raise Cancelled("stream ended before its finish frame")
        except TransferError as e:
            if e.fatal:
                with self._lock:
                    self._end(ib, TransferState.FAILED, e.message, e.code)
            raise
        finally:
            with self._lock:
                ib.streams -= 1

    def _admit(self, msg) -> Inbound:
        with self._lock:
            ib = self._live.get(msg.reservation_id)
            if ib is None:
                ended = self._ended.get(msg.reservation_id)
                if ended is not None:
                    raise FailedPrecondition(f"reservation {msg.reservation_id} already ended: {ended.state.value}"
                                             + (f" ({ended.reason})" if ended.reason else ""))
                raise UnknownReservation(f"no reservation {msg.reservation_id!r} on this receiver")
            if not hmac.compare_digest(msg.nonce.encode(), ib.desc.nonce.encode()):
                raise PermissionDenied(f"wrong nonce for reservation {msg.reservation_id}")
            if msg.request_id != ib.desc.request_id:
                raise PermissionDenied(f"reservation {msg.reservation_id} is bound to another request")
            self._check_live(ib)
            if ib.streams:
                raise _not_fatal(FailedPrecondition(f"reservation {msg.reservation_id} already has a stream"))
            ib.streams += 1
            return ib

    def _accept_chunk(self, ib: Inbound, msg, payload) -> None:
        header = codec.check_chunk(msg, self.layout, ib.desc.num_tokens, self.config.max_chunk_bytes)
        with self._lock:
            self._check_live(ib)
            ib.received_bytes += header.byte_length
            if ib.received_bytes > ib.max_stream_bytes:
                raise ResourceExhausted(f"transfer received {ib.received_bytes} bytes, over its "
                                        f"{ib.max_stream_bytes}-byte budget")
        codec.verify_payload(header, payload)
        with self._lock:
            self._check_live(ib)
            if ib.mark(header):
                ib.chunks += 1
                ib.bytes += header.byte_length
                ib.pending_writes += 1
                self._writes.append((ib, header, payload))
                self._work.set()
            else:
                ib.duplicates += 1

    def _accept_finish(self, ib: Inbound, msg) -> PushResult:
        with self._lock:
            self._check_live(ib)
            if ib.covered != ib.total_cells:
                raise FailedPrecondition(f"finish before all KV arrived: {ib.missing()}")
            if msg.num_chunks != ib.chunks:
                raise DataLoss(f"sender sent {msg.num_chunks} chunks, receiver accepted {ib.chunks}")
            ib.first_token = msg.first_token_id
            self._work.set()
            return PushResult("done", "", ib.chunks, ib.duplicates, ib.bytes)

    # ---- both --------------------------------------------------------------------------------
    def status(self, reservation_id: str) -> TransferStatus:
        with self._lock:
            ib = self._live.get(reservation_id)
            if ib is not None:
                return ib.status()
            if reservation_id in self._ended:
                return self._ended[reservation_id]
        raise UnknownReservation(f"no transfer for reservation {reservation_id!r}")

    @property
    def num_live(self) -> int:
        return len(self._live)

    # ---- internals ---------------------------------------------------------------------------
    def _check_live(self, ib: Inbound) -> None:
        """Lock held. Refuse frames for an ended transfer; end it if its lease lapsed."""
        if not ib.state.terminal and self.clock() >= ib.expires_at:
            self._end(ib, TransferState.FAILED, "reservation expired", ErrorCode.FAILED_PRECONDITION)
        if ib.state.terminal:
            raise _not_fatal(FailedPrecondition(f"reservation {ib.desc.reservation_id} already ended: "
                                                f"{ib.state.value} ({ib.reason})"))

    def _end(self, ib: Inbound, state: TransferState, reason: str | None, code: ErrorCode | None) -> None:
        """Lock held. Ends the transfer once; DONE ones leave the live table now, FAILED ones when pump
        (engine thread) has freed their pages."""
        if not ib.end(state, reason, code):
            return
        self._work.set()
        if state == TransferState.DONE:
            self._retire(ib)
        if self.on_end is not None:
            self.on_end(ib.desc.reservation_id, ib.status())

    def _retire(self, ib: Inbound) -> None:
        rid = ib.desc.reservation_id
        self._live.pop(rid, None)
        self._ended[rid] = ib.status()
        while len(self._ended) > self._remember:
            self._ended.popitem(last=False)

    def _take_writes(self) -> list[tuple[Inbound, codec.ChunkHeader, memoryview]]:
        """Lock held. Queued writes of live transfers, up to the per-pump byte budget."""
        budget = self.config.apply_bytes_per_pump
        out, used = [], 0
        while self._writes and (budget is None or used < budget or not out):
            ib, h, payload = self._writes.popleft()
            if ib.state.terminal:
                ib.pending_writes -= 1
                continue
            out.append((ib, h, payload))
            used += h.byte_length
        return out

    def _free_failed(self) -> None:
        """Engine thread: cancel the reservations of failed transfers (their pages return to the pool)."""
        with self._lock:
            failed = [ib for ib in self._live.values() if ib.state == TransferState.FAILED]
            if failed:
                self._writes = deque(w for w in self._writes if w[0].state != TransferState.FAILED)
            for ib in failed:
                self._retire(ib)
        for ib in failed:
            self.llm.allocator.cancel(ib.desc.reservation_id, "failed")

    def _commit(self, ib: Inbound) -> str | None:
        """Engine thread: hand the filled reservation to the engine as a running request."""
        try:
            rid = self.llm.add_prefilled_request(ib.prompt, ib.first_token, ib.desc.reservation_id,
                                                 ib.params, ib.desc.request_id)
        except (InvalidRequestError, ReservationError) as e:  # raised before any page changes hands
            with self._lock:
                self._end(ib, TransferState.FAILED, f"commit refused: {e}", ErrorCode.FAILED_PRECONDITION)
            self._free_failed()
            return None
        with self._lock:
            self._end(ib, TransferState.DONE, None, None)
        return rid
