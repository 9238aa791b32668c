"""`KVSender`: the `KVSource` of a prefill engine -- publish each layer's KV as soon as it exists.

Order of use (engine thread):
    tx = KVSender(llm, make_transport("grpc"), SenderConfig())
    rid = llm.add_request(prompt_ids, params, prefill_only=True)
    tx.send(rid, descriptor, address)     # descriptor: from the decode side's KVReceiver.reserve()
    while ...: tx.step()                   # = llm.step() then tx.poll()
    tx.status(rid)                         # pending / transferring / done / failed(reason)

`send()` registers a layer hook on the engine's runner (once). After every layer of every step, the
hook copies the stored K/V of the tokens that step just computed for a sending request (read by the
request's own slots) into that transfer's queue -- a memcpy on the engine thread (device pages: queued
non-blocking copies into pinned host memory, which the push thread waits for) -- so layer i is on the
wire while layers i+1.. and later prefill chunks compute. A request already HELD when `send()` is called
is read by the push side instead, layer by layer: its pages cannot change until we release them.
Prefix caching: a descriptor with `kv_start` > 0 (the decode side shared that many tokens of cached prefix
into the reservation) is shipped from there on only. The prefill engine's own cache may have let it skip
computing a prefix; tokens in [kv_start, its first computed token) are then read by slot from the cached
pages the request holds (they cannot change while it holds them) at the first layer hook.
A push thread per transfer runs `transport.push()` over `Outbound.frames()`, which cuts what is queued
into ~`chunk_bytes` chunks (XXH3-64 checksum each; frames are wire bytes) off the engine thread. The
call opens only when the first KV (or the end) is queued: its gRPC deadline (`call_timeout_s`) then
times the transfer, not the prompt's wait in the prefill queue, and a receiver's stream slots are held
only by prompts being computed. When
the prefill ends HELD, `poll()` queues the `Finish` frame (first token); once the push has ended, done
or failed, and its thread has exited, `poll()` releases the held pages (or aborts a prefill whose
transfer failed). A preempted prefill recomputes; tokens already published are not sent again.
Eviction: when the engine will thin a request's KV at the end of its prefill (`llm.will_evict`), nothing
is published per layer (which tokens survive is known only then); once HELD, the kept tokens --
compacted to the front of its pages -- are shipped like a HELD request's, and the Finish frame says how
many (`num_slots`), so the decode side adopts that many slots and frees the rest of its reservation.
Tensor/pipeline-parallel prefill (`llm.backend is None`: the pages live in the rank processes, which run
no layer hooks): nothing is published per layer; after each step (`poll()`), the engine thread reads the
tokens that step computed, every layer, out of the ranks with `engine.parallel.kv_io.export_heads` (one
piece per layer and distinct KV-head group, or per stage's layers) and queues them addressed by global KV
heads, so a chunked prefill's chunks leave as they are computed; the rest once it is HELD. The transfer is
described in the replica's whole layout (`llm.kv_spec`: every layer and KV head, tp 0 of 1), so its
signature is the model-level one and a decode replica of another layout takes it and maps heads and
layers to its own ranks (`KVReceiver`); a shard's spec has another signature and is refused.
"""
from __future__ import annotations

import queue
import threading
from collections import OrderedDict

from engine.kv_cache.page_io import export_kv, export_kv_async, stored_token_head_bytes
from engine.parallel.kv_io import export_heads
from engine.request import RequestStatus
from kv_transfer import codec
from kv_transfer.config import SenderConfig
from kv_transfer.contract import (EndObserver, ErrorCode, FailedPrecondition, InvalidFrame, TransferDescriptor,
                                  TransferError, TransferState, TransferStatus, UnknownReservation)


class Outbound:
    """One transfer out of one prefill request. Engine thread: publish/finish/abort; push thread: frames()."""

    def __init__(self, request_id: str, desc: TransferDescriptor, address: str, layout: codec.TransferLayout,
                 prompt: list[int], num_kv_heads: int, chunk_bytes: int, started_at: float):
        self.request_id, self.desc, self.address, self.layout = request_id, desc, address, layout
        self.started_at = started_at
        self._open = codec.encode(codec.open_frame(desc, layout, prompt, num_kv_heads))
        self._chunk_bytes = chunk_bytes
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.cancelled = threading.Event()  # set on abort: the transport gives up on the call
        self.ready = threading.Event()  # something is queued: the push thread may open the call
        # tokens queued per local layer (engine thread); [0, kv_start) are on the decode side already
        self.published = [desc.kv_start] * layout.num_local_layers
        self.input_closed = False  # finish or abort queued (engine thread)
        self.state, self.reason, self.code = TransferState.PENDING, None, None
        self.bytes = self.chunks = 0
        self.threads: list[threading.Thread] = []  # the push thread
        self.deferred = False  # evicting or parallel prefill: ship the pages once it is HELD, not per layer
        self.evicts = False  # the prefill thins its KV: the finish frame says how many tokens were kept

    # engine thread
    def publish(self, layer: int, start: int, stop: int, k: memoryview, v: memoryview,
                heads: range | None = None, ready=None) -> None:
        """Queue copies of the stored K/V of tokens [start, stop) of one layer (all heads, or the global
        KV heads `heads` only: one rank's part of a parallel replica). `ready`: from `export_kv_async`
        (device pages: the copy to host may still be running; the push thread waits on it, not us)."""
        self._q.put(("kv", layer, start, stop, k, v, heads, ready))
        self.published[layer - self.layout.layer_start] = stop
        self.ready.set()

    def publish_held(self, backend, pages: list[int], num_tokens: int, start: int = 0) -> None:
        """Queue tokens [start, num_tokens) of every layer of a HELD request, read by the push thread layer
        by layer (pipelined with sending). Safe off the engine thread: nothing writes or frees a HELD
        request's pages until the engine thread releases them, which `KVSender` does only after the push
        thread has exited (shared cached pages among them are read-only to everyone)."""
        self._q.put(("held", backend, pages, start, num_tokens))
        self.published = [num_tokens] * self.layout.num_local_layers
        self.ready.set()

    def finish(self, first_token_id: int, num_slots: int = 0) -> None:
        """num_slots: tokens of KV shipped, when the prefill evicted some (0: the whole prompt)."""
        self.input_closed = True
        self._q.put(("finish", first_token_id, num_slots))
        self.ready.set()

    def abort(self, reason: str, code: ErrorCode = ErrorCode.CANCELLED) -> None:
        self.end(TransferState.FAILED, reason, code)
        self.input_closed = True
        self.cancelled.set()
        self._q.put(("abort",))
        self.ready.set()

    # push thread
    def frames(self):
        """Wire bytes: open, then chunks as layers are published, then finish; ends early on abort."""
        with self._lock:
            if self.state == TransferState.PENDING:
                self.state = TransferState.TRANSFERRING
        yield self._open
        while True:
            item = self._q.get()
            if item[0] == "finish":
                yield codec.encode(codec.finish_frame(item[1], self.chunks, item[2]))
                return
            if item[0] == "abort":
                return
            if item[0] == "kv":
                if item[7] is not None:
                    item[7]()  # device pages: their copy into pinned host memory has landed
                yield from self._chunks(*item[1:7])
                continue
            _, backend, pages, a, n = item
            for layer in range(self.layout.layer_start, self.layout.layer_end):
                if self.cancelled.is_set():
                    return
                yield from self._chunks(layer, a, n, *export_kv(backend, layer, pages, a, n, copy=False))

    def _chunks(self, layer: int, start: int, stop: int, k: memoryview, v: memoryview, heads: range | None = None):
        nh = self.layout.num_heads if heads is None else len(heads)
        row = self.layout.payload_bytes(1, nh) // 2  # bytes of one token's K (or V)
        for a, b in codec.plan_token_ranges(start, stop, self.layout, self._chunk_bytes, nh):
            lo, hi = (a - start) * row, (b - start) * row
            self.chunks += 1
            self.bytes += 2 * (hi - lo)
            yield codec.chunk_wire(self.layout, layer, a, b, k[lo:hi], v[lo:hi], heads)

    # either thread
    def end(self, state: TransferState, reason: str | None = None, code: ErrorCode | None = None) -> bool:
        with self._lock:
            if self.state.terminal:
                return False
            self.state, self.reason, self.code = state, reason, code
            return True

    @property
    def ended(self) -> bool:
        return self.state.terminal

    @property
    def settled(self) -> bool:
        """Ended, and no thread of this transfer reads anything any more."""
        return self.ended and not any(t.is_alive() for t in self.threads)

    def status(self) -> TransferStatus:
        return TransferStatus(self.state, self.reason, self.code, self.bytes, self.chunks)


class KVSender:
    def __init__(self, llm, transport, config: SenderConfig | None = None, clock=None,
                 on_end: EndObserver | None = None, remember_ended: int = 4096):
        self.llm = llm
        self._remember = remember_ended
        self.transport = transport
        self.config = config or SenderConfig()
        self.clock = clock or llm.clock
        self.on_end = on_end
        self.layout = codec.TransferLayout.from_spec(llm.kv_spec, stored_token_head_bytes(llm.kv_spec))
        self._out: dict[str, Outbound] = {}
        self._ended: OrderedDict[str, TransferStatus] = OrderedDict()  # the last `remember_ended`
        self._threads: list[threading.Thread] = []
        self._hooked = False
        self.parallel = llm.backend is None  # TP/PP: pages in the rank processes, read once HELD (no hooks)

    def send(self, request_id: str, desc: TransferDescriptor, address: str) -> None:
        """Start shipping the KV of prefill-only request `request_id` into the reservation `desc`."""
        req = self.llm.requests.get(request_id)
        if req is None or not req.prefill_only:
            raise UnknownReservation(f"{request_id!r} is not a live prefill-only request of this engine")
        if request_id in self._out:
            raise FailedPrecondition(f"{request_id!r} is already being sent")
        if desc.model_fingerprint != self.llm.fingerprint or desc.layout_signature != self.llm.kv_spec.signature():
            raise FailedPrecondition(f"descriptor for model {desc.model_fingerprint}/layout {desc.layout_signature};"
                                     f" this engine has {self.llm.fingerprint}/{self.llm.kv_spec.signature()}")
        if desc.num_tokens != req.num_prompt:
            raise InvalidFrame(f"reservation holds {desc.num_tokens} tokens; the prompt has {req.num_prompt}")
        if not 0 <= desc.kv_start <= desc.num_tokens:
            raise InvalidFrame(f"kv_start {desc.kv_start} outside the {desc.num_tokens}-token prompt")
        if desc.kv_start and self.llm.will_evict(request_id):
            raise FailedPrecondition("this prefill evicts KV, which cannot fill a reservation on shared cached "
                                     f"prefix pages (kv_start {desc.kv_start})")
        # kivi4 ships whole (sealed) pages only; the decode side recomputes a tail ending inside a page (kivi.py)
        if not self._hooked and not self.parallel:
            self.llm.runner.add_layer_hook(self._on_layer)
            self._hooked = True
        ob = Outbound(request_id, desc, address, self.layout, list(req.prompt_token_ids),
                      self.llm.kv_spec.num_kv_heads, self.config.chunk_bytes, self.clock())
        self._out[request_id] = ob
        ob.evicts = self.llm.will_evict(request_id)
        ob.deferred = ob.evicts or self.parallel
        if request_id in self.llm.tables and not ob.deferred:  # computed before send(): publish what is there
            self._publish_cached(ob, req.status == RequestStatus.HELD)
        push = threading.Thread(target=self._push, args=(ob,), name=f"kv-push-{request_id}", daemon=True)
        ob.threads = [push]
        push.start()
        self.poll()

    def step(self):
        """One prefill-loop iteration: one engine step, then poll (its outputs)."""
        outs = self.llm.step()
        self.poll()
        return outs

    def poll(self) -> None:
        """Queue finish for prefills that ended HELD, enforce deadlines, settle ended transfers."""
        now = self.clock()
        for rid, ob in list(self._out.items()):
            req = self.llm.requests.get(rid)
            if not ob.input_closed:
                if req is None or req.finished:
                    ob.abort("the prefill request ended without its KV (finished at its first token or aborted)")
                elif req.status == RequestStatus.HELD and ob.deferred:  # evicted/parallel: ship the pages now
                    self._publish_cached(ob, held=True)
                    ob.finish(req.output_token_ids[0], self.llm.tables.get(rid).num_slots if ob.evicts else 0)
                elif req.status == RequestStatus.HELD:
                    ob.finish(req.output_token_ids[0])
                elif self.parallel and not ob.evicts and req.status == RequestStatus.RUNNING:
                    self._publish_ranks(ob, req.num_computed)  # chunked prefill: this step's chunk leaves now
            deadline = self.config.deadline_s
            if deadline is not None and not ob.ended and now - ob.started_at >= deadline:
                ob.abort(f"deadline of {deadline}s exceeded", ErrorCode.DEADLINE_EXCEEDED)
            if ob.ended and not ob.input_closed:
                ob.abort("transfer ended")  # no-op on the state; unblocks frames() wherever it waits
            if ob.settled:
                self._settle(ob, req)

    def status(self, request_id: str) -> TransferStatus:
        if request_id in self._out:
            return self._out[request_id].status()
        if request_id in self._ended:
            return self._ended[request_id]
        raise UnknownReservation(f"no transfer for request {request_id!r}")

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        ob = self._out.get(request_id)
        if ob is not None:
            ob.abort(reason)
            self.poll()

    def close(self, timeout_s: float = 10.0) -> None:
        """Abort what is still sending, wait for the push threads, and settle everything."""
        for ob in list(self._out.values()):
            ob.abort("sender closed")
        for ob in list(self._out.values()):
            for t in ob.threads:
                t.join(timeout_s)
        self.poll()
        for t in self._threads:
            t.join(timeout_s)
        self._threads = [t for t in self._threads if t.is_alive()]
        if self._hooked:
            self.llm.runner.remove_layer_hook(self._on_layer)
            self._hooked = False

    @property
    def num_live(self) -> int:
        return len(self._out)

    # ---- internals ---------------------------------------------------------------------------
    def _on_layer(self, layer: int, batch) -> None:
        """Runs on the engine thread after each layer: queue the K/V this step just computed."""
        if not self._out:
            return
        for s in batch.seqs:
            ob = self._out.get(s.request_id)
            if ob is None or ob.input_closed or ob.deferred:
                continue
            # From what was queued, not from this chunk's start: tokens before the chunk are in the
            # request's pages (earlier chunks, or cached prefix pages its own cache shared in), and the
            # decode side may lack some of them -- the gap [kv_start, cached prefix) is read by slot here.
            start = ob.published[layer - self.layout.layer_start]
            stop = s.num_cached + len(s.token_ids)
            if self.llm.kv_spec.storage_format == "kivi4":  # a page leaves once sealed (its last slot written)
                stop -= stop % self.llm.kv_spec.page_size
            if stop > start:  # (device pages: queued copies to host; the engine thread does not wait)
                k, v, ready = export_kv_async(self.llm.backend, layer, s.pages, start, stop)
                ob.publish(layer, start, stop, k, v, ready=ready)

    def _publish_cached(self, ob: Outbound, held: bool) -> None:
        table = self.llm.tables.get(ob.request_id)
        n, a = min(table.num_slots, ob.desc.num_tokens), ob.desc.kv_start
        if self.llm.kv_spec.storage_format == "kivi4":  # sealed pages only; the rest follows per layer
            n -= n % self.llm.kv_spec.page_size
        if n <= a:
            return
        if self.parallel:
            self._publish_ranks(ob, n)
            return
        if held:  # pages frozen until we release them: let the push thread read them, layer by layer
            ob.publish_held(self.llm.backend, list(table.pages), n, a)
            return
        for layer in self.llm.kv_spec.local_layers:  # still running (chunked prefill): copy now
            k, v, ready = export_kv_async(self.llm.backend, layer, table.pages, a, n)
            ob.publish(layer, a, n, k, v, ready=ready)

    def _publish_ranks(self, ob: Outbound, stop: int) -> None:
        """Parallel prefill: tokens [queued so far, stop) of every layer, read out of the ranks here, on the
        engine thread (they answer one caller at a time), after each step of a prefill still running (chunk
        i is on the wire while chunk i + 1 computes) and once it is HELD."""
        table = self.llm.tables.get(ob.request_id)
        a = min(ob.published)  # every layer is queued together, from desc.kv_start on
        n = min(stop, table.num_slots if table is not None else 0, ob.desc.num_tokens)
        if n <= a:
            return
        for c in export_heads(self.llm, list(self.llm.kv_spec.local_layers), list(table.pages), a, n):
            ob.publish(c.layer, a, n, memoryview(c.k), memoryview(c.v), c.heads)

    def _push(self, ob: Outbound) -> None:
        """Push thread: once something is queued, run the transport; every outcome ends the transfer (once)."""
        ob.ready.wait()
        # Aborted before any KV existed: the call still opens, sends the open frame and ends without a
        # finish, so the receiver fails the reservation now rather than at its lease (a cancel this early
        # could stop the call before the receiver ever saw it).
        cancel = threading.Event() if ob.cancelled.is_set() else ob.cancelled
        try:
            result = self.transport.push(ob.address, ob.frames(), self.config, cancel)
        except TransferError as e:
            ob.end(TransferState.FAILED, e.message, e.code)
        except Exception as e:  # a thread boundary: any bug still ends the transfer, typed as INTERNAL
            ob.end(TransferState.FAILED, f"{type(e).__name__}: {e}", ErrorCode.INTERNAL)
        else:
            if result.state == "done":
                ob.end(TransferState.DONE)
            else:
                ob.end(TransferState.FAILED, result.reason or "receiver reported failure", ErrorCode.INTERNAL)
        finally:
            ob.cancelled.set()  # a transport thread still inside frames() stops before reading more pages

    def _settle(self, ob: Outbound, req) -> None:
        """Engine thread: the push ended; give the prefill's pages back and forget the transfer."""
        if req is not None and req.status == RequestStatus.HELD:
            self.llm.release_held(ob.request_id)
        elif req is not None and not req.finished:
            self.llm.abort(ob.request_id)  # the KV has nowhere to go: stop computing it
        self._out.pop(ob.request_id)
        self._ended[ob.request_id] = ob.status()
        while len(self._ended) > self._remember:
            self._ended.popitem(last=False)
        self._threads = [t for t in self._threads if t.is_alive()] + ob.threads
        if self.on_end is not None:
            self.on_end(ob.request_id, ob.status())
