"""`KVReceiver`: the `KVSink` of a decode engine -- reserve pages, admit pushes, write chunks, commit.

Order of use (engine thread unless noted):
    rx = KVReceiver(llm, ReceiverConfig());  address = rx.serve(make_transport("grpc"))
    desc = rx.reserve(num_tokens, params)      # pages held under a lease; desc goes to the prefill side
    ... transport threads call rx.handle_push(frames, token) for each incoming stream ...
    rx.step()                                  # = rx.pump() then llm.step(), in the decode loop
    rx.status(desc.reservation_id)             # pending / transferring / done / failed(reason)

Threading. The engine is single-threaded; transport threads never touch the allocator, the scheduler or any
page a step may read. `reserve()` pins the reserved pages with a second owner (`kvrx:<id>`), so they stay
out of the free list -- whatever happens to the reservation's lease -- until the engine thread unpins them.
A transport thread authenticates, admits the stream against the reservation (nonce, model fingerprint,
layout signature), checks each chunk's counts and sizes, verifies its checksum, records its cells under a
small lock (refusing chunks of a transfer that ended or whose lease lapsed), and then writes it straight
into the pinned pages (token range -> slot runs of this engine's page size): those pages are disjoint from
everything a decode step reads or writes, so no engine lock is needed and the decode step loop pays nothing
per chunk (device pages: page_io writes them on a copy stream of its own, ordered after a fence taken at
`reserve()`, and returns once they landed). `pump()`, on the engine thread, expires leases, fails transfers
whose reservation ended, frees (cancel + unpin) failed transfers once no write of theirs is in flight -- so
a late chunk can only ever land in pages still pinned for it -- and commits ready transfers through
`LLM.add_prefilled_request`. An `RLock` guards the transfer records; it is never held while bytes are
copied. Prefix caching: `reserve(..., token_ids=prompt)` shares the engine's cached prefix pages into the
reservation; the descriptor's `kv_start` (= shared pages x page size) is where the KV to receive begins:
chunks below it are refused (InvalidFrame; nothing writes a shared page), the open frame must announce the
same start, and completeness counts cells from it.
Tensor/pipeline-parallel decode (`llm.backend is None`): the reservation is addressed in the replica's
whole layout (global KV heads and layers, the model-level signature), so a prefill replica of any layout
may fill it; each chunk is written with `engine.parallel.kv_io.import_heads` into every rank holding one
of its heads (the stage holding its layer), from the transport thread like any other chunk (the rank
processes serialize callers: a write waits for a running step, and lands in pinned pages it never reads).
kivi4: only the prompt's whole (sealed) pages arrive (`kivi.shipped_tokens`; a chunk past them is refused);
the commit tells the engine to recompute the tail of a prompt ending inside a page (`num_computed`).
"""
from __future__ import annotations

import contextlib
import hmac
import threading
import time
from collections import OrderedDict

from engine.errors import InvalidRequestError, ReservationError
from engine.kv_cache.kivi import shipped_tokens
from engine.kv_cache.page_io import import_kv, stored_token_head_bytes, stream_fence
from engine.parallel.errors import RankFailedError
from engine.parallel.kv_io import HeadChunk, import_heads
from kv_transfer import codec
from kv_transfer.config import ReceiverConfig, check_bind, check_token
from kv_transfer.contract import (Cancelled, DataLoss, EndObserver, ErrorCode, FailedPrecondition,
                                  InvalidFrame, PermissionDenied, PushResult, ResourceExhausted,
                                  TransferDescriptor, TransferError, TransferState, TransferStatus,
                                  Unavailable, UnknownReservation)
from kv_transfer.inbound import Inbound


def _pin(reservation_id: str) -> str:
    return f"kvrx:{reservation_id}"


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
        self.clock_wall = time.monotonic  # only for close()'s bounded wait on writes in flight
        self._token = self.config.token()
        self._lock = threading.RLock()
        self._live: dict[str, Inbound] = {}  # reservation id -> transfer (failed ones until pump frees them)
        self._ended: OrderedDict[str, TransferStatus] = OrderedDict()
        self._remember = remember_ended
        self._work = threading.Event()  # set when pump() has something to do (ready, failed, write done)
        self._stepping = False  # inside step()'s engine step: chunks are paced (decode priority)
        self._pace_next = 0.0
        self.server = None

    # ---- engine thread -----------------------------------------------------------------------
    def serve(self, transport) -> str:
        """Start receiving on `transport`; refuses a non-loopback bind without a token. Returns the address."""
        check_bind(self.config.host, self._token)
        self.server = transport.serve(self, self.config)
        return self.server.address

    def reserve(self, num_tokens: int, params=None, request_id: str | None = None,
                lease_s: float = 30.0, token_ids: list[int] | None = None) -> TransferDescriptor:
        """Hold pages for `num_tokens` of incoming KV (OutOfPagesError if none) and describe the transfer.
        `token_ids` (the prompt; the engine's prefix cache on): its cached prefix pages are shared into the
        reservation, and the descriptor's `kv_start` says where the KV still to ship begins."""
        if num_tokens < 1:
            raise InvalidFrame(f"cannot reserve for {num_tokens} tokens")
        if token_ids is not None and len(token_ids) != num_tokens:
            raise InvalidFrame(f"{len(token_ids)} prompt token ids for a {num_tokens}-token reservation")
        res = self.llm.reserve(num_tokens, lease_s, token_ids=token_ids)
        self.llm.allocator.share(_pin(res.reservation_id), res.pages)  # ours until the engine thread unpins
        start = min(res.num_shared * self.llm.kv_spec.page_size, num_tokens)
        desc = TransferDescriptor(request_id or f"kv-{res.reservation_id}", res.reservation_id, res.nonce,
                                  self.llm.fingerprint, self.llm.kv_spec.signature(), num_tokens, start)
        cap = int(self.layout.transfer_bytes(num_tokens - start) * self.config.stream_bytes_factor)
        ib = Inbound(desc, self.layout, list(res.pages), params, res.expires_at,
                     cap + self.config.max_chunk_bytes, num_shipped=shipped_tokens(self.llm.kv_spec, num_tokens))
        if self.llm.backend is not None:  # device pages: chunks are written on a side stream, after this point
            ib.fence = stream_fence(self.llm.backend)
        with self._lock:
            self._live[res.reservation_id] = ib
        return desc

    def wait_for_work(self, timeout_s: float) -> bool:
        """For an idle decode loop: block until a transport thread gives pump() work (True) or timeout."""
        return self._work.wait(timeout_s)

    def pump(self) -> list[str]:
        """Expire leases, free failed transfers' pages, commit ready transfers; returns the request ids
        that joined the engine."""
        self.llm.allocator.expire()
        with self._lock:
            self._work.clear()
            for rid, ib in self._live.items():
                why = self.llm.allocator.finished_reason(rid)
                if why is not None:
                    self._end(ib, TransferState.FAILED, f"reservation {why}", ErrorCode.FAILED_PRECONDITION)
            ready = [ib for ib in self._live.values() if ib.ready]
            for ib in ready:
                ib.committing = True  # from here on only this thread ends it
        self._free_failed()
        return [rid for rid in map(self._commit, ready) if rid is not None]

    def step(self):
        """One decode-loop iteration: pump, then one engine step (its outputs)."""
        self.pump()
        with self.decoding():
            return self.llm.step()

    @contextlib.contextmanager
    def decoding(self):
        """Wrap an engine step: while inside, incoming chunks are paced to `config.paced_bytes_per_s`
        (decode priority), if set. `step()` uses it; a worker with its own loop wraps its steps."""
        self._stepping = True
        try:
            yield
        finally:
            self._stepping = False

    def cancel(self, reservation_id: str, reason: str = "cancelled") -> None:
        with self._lock:
            ib = self._live.get(reservation_id)
            if ib is not None:
                self._end(ib, TransferState.FAILED, reason, ErrorCode.CANCELLED)
        self._free_failed()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop serving, fail every live transfer and free its pages (once its writes in flight land)."""
        if self.server is not None:
            self.server.stop()
            self.server = None
        for rid in list(self._live):
            self.cancel(rid, "receiver closed")
        end = self.clock_wall() + timeout_s
        while self._live and self.clock_wall() < end:
            self._work.wait(0.01)
            self._free_failed()

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
                                ib.desc.num_tokens, ib.desc.kv_start)
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
                    if not ib.committing:
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
        header = codec.check_chunk(msg, self.layout, ib.desc.num_tokens, self.config.max_chunk_bytes,
                                   ib.desc.kv_start)
        if header.token_end > ib.shipped:  # kivi4: a page not sealed on the sender has no cells to ship
            raise InvalidFrame(f"chunk tokens [{header.token_start}, {header.token_end}) pass the {ib.shipped} "
                               f"tokens of whole {self.llm.kv_spec.storage_format} pages this reservation takes")
        self._pace(header.byte_length)
        with self._lock:
            self._check_live(ib)
            ib.received_bytes += header.byte_length
            if ib.received_bytes > ib.max_stream_bytes:
                raise ResourceExhausted(f"transfer received {ib.received_bytes} bytes, over its "
                                        f"{ib.max_stream_bytes}-byte budget")
        codec.verify_payload(header, payload)
        with self._lock:
            self._check_live(ib)
            if not ib.mark(header):
                ib.duplicates += 1
                return
            ib.chunks += 1
            ib.bytes += header.byte_length
            ib.pending_writes += 1
        try:  # outside the lock: the pages are pinned for this transfer, and no step touches them
            self._write(ib, header, payload)
        finally:
            with self._lock:
                ib.pending_writes -= 1
                if ib.ready or (ib.state.terminal and not ib.pending_writes):
                    self._work.set()  # pump has something to do: commit, or free

    def _write(self, ib: Inbound, h, payload) -> None:
        """A checked chunk into the reservation's pages: this process's pool, or the ranks holding its heads."""
        if self.llm.backend is not None:
            import_kv(self.llm.backend, h.layer, ib.pages, h.token_start, h.token_end, payload,
                      h.head_start - self.layout.head_start, h.head_end - self.layout.head_start, after=ib.fence)
            return
        half = h.byte_length // 2  # K then V
        chunk = HeadChunk(h.layer, range(h.head_start, h.head_end), payload[:half], payload[half:])
        try:
            import_heads(self.llm, chunk, ib.pages, h.token_start, h.token_end)
        except RankFailedError as e:  # the replica is down (every rank stopped): fail this transfer, typed
            raise Unavailable(f"decode replica lost a rank while writing KV: {e}") from None

    def _accept_finish(self, ib: Inbound, msg) -> PushResult:
        with self._lock:
            self._check_live(ib)
            if msg.num_slots and ib.desc.kv_start:
                raise FailedPrecondition("evicted KV (finish num_slots) cannot fill a reservation on shared "
                                         f"cached prefix pages (kv_start {ib.desc.kv_start})")
            if 0 < msg.num_slots < ib.desc.num_tokens:  # the prefill evicted KV: only the kept tokens came
                if not ib.covers_prefix(msg.num_slots):
                    raise FailedPrecondition(f"finish announces {msg.num_slots} kept tokens; the chunks received "
                                             f"do not cover exactly tokens [0, {msg.num_slots}) of every layer")
                ib.num_slots = msg.num_slots
            elif msg.num_slots not in (0, ib.desc.num_tokens):
                raise InvalidFrame(f"finish num_slots {msg.num_slots} exceeds the reservation's "
                                   f"{ib.desc.num_tokens} tokens")
            if ib.covered != ib.total_cells:
                raise FailedPrecondition(f"finish before all KV arrived: {ib.missing()}")
            if ib.first_token is not None:
                raise _not_fatal(FailedPrecondition("transfer already finished"))
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
    def _pace(self, nbytes: int) -> None:
        """Decode priority: while the engine steps, take chunks no faster than `paced_bytes_per_s`
        (gRPC flow control then holds the sender back too), leaving the CPU to the decode step.
        Wall-clock pacing, not a deadline: it does not read the injectable clock."""
        rate = self.config.paced_bytes_per_s
        if rate is None or not self._stepping:
            return
        with self._lock:
            now = time.monotonic()
            start = max(self._pace_next, now)
            self._pace_next = start + nbytes / rate
        if start > now:
            time.sleep(start - now)

    def _check_live(self, ib: Inbound) -> None:
        """Lock held. Refuse frames for an ended transfer; end it if its lease lapsed."""
        if not ib.state.terminal and not ib.committing and self.clock() >= ib.expires_at:
            self._end(ib, TransferState.FAILED, "reservation expired", ErrorCode.FAILED_PRECONDITION)
        if ib.state.terminal:
            raise _not_fatal(FailedPrecondition(f"reservation {ib.desc.reservation_id} already ended: "
                                                f"{ib.state.value} ({ib.reason})"))
        if ib.committing:
            raise _not_fatal(FailedPrecondition(f"reservation {ib.desc.reservation_id} is complete"))

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

    def _free_failed(self) -> None:
        """Engine thread: cancel and unpin failed transfers whose writes have all landed (their pages
        return to the pool; a write still in flight keeps them pinned until the next pump)."""
        with self._lock:
            failed = [ib for ib in self._live.values()
                      if ib.state == TransferState.FAILED and ib.pending_writes == 0]
            for ib in failed:
                self._retire(ib)
        for ib in failed:
            self.llm.allocator.cancel(ib.desc.reservation_id, "failed")
            self._unpin(ib)

    def _unpin(self, ib: Inbound) -> None:
        self.llm.allocator.release(_pin(ib.desc.reservation_id), ib.pages)

    def _commit(self, ib: Inbound) -> str | None:
        """Engine thread: hand the filled reservation to the engine as a running request."""
        try:
            rid = self.llm.add_prefilled_request(ib.prompt, ib.first_token, ib.desc.reservation_id,
                                                 ib.params, ib.desc.request_id, num_slots=ib.num_slots,
                                                 num_computed=ib.num_shipped if ib.num_slots is None else None)
        except (InvalidRequestError, ReservationError) as e:  # raised before any page changes hands
            with self._lock:
                self._end(ib, TransferState.FAILED, f"commit refused: {e}", ErrorCode.FAILED_PRECONDITION)
            self._free_failed()
            return None
        self._unpin(ib)  # the request's own reference keeps the pages now
        with self._lock:
            self._end(ib, TransferState.DONE, None, None)
        return rid
