"""`DecodeWorker`: one decode engine (`engine.LLM`) and its `KVReceiver`, driven by a plain step loop.

Who calls it: `cluster/serving/actors.py` runs it on one thread of a Ray actor (tests run it in-process); every
method runs on that thread, while the receiver's transport threads accept pushes beside it. Life of a
request here (docs/design.md "Life of a request", steps 3 and 6):

    reserve(rid, prompt_ids, params, lease_s) -> TransferDescriptor, or None ("no pages now": the router
        tries another worker or waits). Admission by free pages: refused while preempted requests wait
        for pages, when the pages for the prompt are not free, or when the running batch is full.
    ... the prefill worker pushes the KV into the reserved pages ...
    step()  = receiver.step(): pump (write chunks, commit complete transfers, which join the running
              batch) then one engine step (continuous batching) -> a `DecodeDelta` per request that
              advanced (new tokens and text; the last one finished)
    abort(rid) -> cancel the reservation or abort the running request; pages freed at once (idempotent)

Preemption: when a running request needs a page and none is free, the engine's scheduler preempts the
newest running request and re-queues it to be recomputed from prompt + generated tokens *on this worker*
(a local prefill; its outputs are kept, so the stream neither loses nor repeats a token). Recomputing
here rather than sending it back through a prefill worker is the simplest correct choice: no second
reservation or transfer can fail, and the prompt is short next to the KV it would move.

Transfer failure: with `failure_policy="recompute"` the request is re-run from its prompt on this worker
(same seed, so the first token the prefill side already streamed comes out again and the router skips
it); with "fail" it ends with a `DecodeDelta` whose `finish_reason` is "error" and `error` says why.

Timeline (unix seconds, in the first `DecodeDelta.times` of a request): transfer_commit (the receiver
handed the filled pages to the engine) and decode_admitted (the engine step that produced its first output here
began); colocated replicas also stamp prefill_start (the step that first computed the prompt) and
prefill_end (its first token), so queue and prefill time separate there too. `stats()` counts KV bytes received.
Per request, the last `DecodeDelta` carries `kv`: kv_pages (the most KV pages it held here at once, from
its reservation on: `BlockTables.peak_pages`) and, for a request whose KV came over the wire, kv_bytes
(payload bytes of its committed transfer); the router folds both into the request's timeline.

Prefix caching (`EngineConfig.enable_prefix_caching`): `reserve` hands the prompt to the receiver, which
shares the engine's cached prefix pages into the reservation; the descriptor's `kv_start` tells the prefill
side to ship only the KV after them. `prefix_info` (salt, page size, pages) lets the router name this
worker's pages with the engine's own hash chain; `stats()` reports `prefix_*` and `kv_bytes_not_received`.

Colocated mode uses the same class without a receiver (`serve_kv=False`): `add_request()` runs both
phases on this engine.

Draft-verify decoding: `EngineConfig.speculative` (a dict from the pool's YAML `speculative:` section,
or an `engine.spec_decode.SpeculativeConfig`) turns it on in the engine (engine/spec_decode: proposers,
verify, adaptive length, load-aware gate); a request's `params.speculative` overrides it per request.
`stats()` reports its counters as `spec_*` fields.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from engine.engine_config import EngineConfig
from engine.errors import OutOfPagesError, PdserveError
from engine.llm import LLM
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from kv_transfer.config import ReceiverConfig
from kv_transfer.contract import TransferDescriptor, TransferState, TransferStatus, make_transport

__all__ = ["DecodeWorker", "DecodeDelta", "DecodeStats"]


@dataclass
class DecodeDelta:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    num_output: int  # output tokens so far (new_token_ids are the last len(new_token_ids) of them)
    text_len: int  # characters of output text so far (new_text is its tail)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "error"
    logprobs: list[tuple[int, float | None, list[tuple[int, float]]]] | None = None  # new tokens only
    num_preemptions: int = 0
    error: str | None = None  # finish_reason "error": why (a failed transfer)
    times: dict[str, float] | None = None  # timeline events (first delta of a request; see the module map)
    kv: dict[str, int] | None = None  # last delta: kv_pages (peak held here), kv_bytes (received; disaggregated)


@dataclass
class DecodeStats:
    free_pages: int = 0
    num_pages: int = 0
    pages_in_use: int = 0
    reservations: int = 0  # pages held for KV in flight (leases)
    receiving: int = 0  # live transfers
    running: int = 0
    waiting: int = 0  # preempted (or colocated) requests waiting for pages
    max_num_seqs: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    num_transfer_failures: int = 0  # of requests this worker still owned (recomputed or ended "error")
    kv_bytes_received: int = 0  # KV payload bytes of committed transfers
    transfers_committed: int = 0
    kv_evicted_tokens: int = 0  # colocated: prompt tokens whose KV eviction dropped
    spec_steps: int = 0  # steps with a request that could draft (0 without speculation)
    spec_share: float = 0.0  # share of those steps that verified drafts
    spec_drafted: int = 0  # draft tokens verified
    spec_accepted: int = 0  # of those, accepted
    spec_acceptance_rate: float = 0.0
    spec_tokens_per_verify: float = 0.0  # tokens one request's verify produced, on average
    spec_verify_cost_ratio: float = 1.0  # last estimate: step time with drafts / without
    spec_draft_token_cost: float = 1.0  # measured: a verified draft token's cost / a decode row's
    # prefix caching (0 when off): cached prefix pages shared into reservations instead of being shipped,
    # and this engine's own lookups (recomputes after preemption or a failed transfer; colocated prompts)
    prefix_shared_received_pages: int = 0
    kv_bytes_not_received: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_hit_rate: float = 0.0
    prefix_cached_pages: int = 0


@dataclass
class _Entry:
    prompt_ids: list[int]
    params: SamplingParams
    reservation_id: str | None = None  # None once it runs here (committed, recomputed or colocated)
    times: dict[str, float] | None = None  # timeline events not yet reported (None once reported)
    kv_bytes: int | None = None  # payload bytes of its committed transfer (None: none committed)


class DecodeWorker:
    def __init__(self, engine: EngineConfig | dict, receiver_config: ReceiverConfig | None = None, transport="grpc",
                 failure_policy: str = "fail", serve_kv: bool = True, llm: LLM | None = None):
        """`engine`: the engine's config (or a dict of its fields); `transport`: a name in `kv_transfer.contract.TRANSPORTS` or a transport object (tests);
        `serve_kv=False`: a colocated replica (no receiver); `llm`: an engine built by the caller (tests)."""
        assert failure_policy in ("fail", "recompute"), failure_policy
        self.llm = llm if llm is not None else LLM(EngineConfig.of(engine))
        self.failure_policy = failure_policy
        self._entries: dict[str, _Entry] = {}
        self._by_reservation: dict[str, str] = {}
        self._failed: deque[tuple[str, TransferStatus]] = deque()  # appended by transport threads
        self._failed_lock = threading.Lock()
        self._pending: list[DecodeDelta] = []  # produced outside step() (failures), returned by the next
        self.num_transfer_failures = 0
        self.kv_bytes_received = self.transfers_committed = 0
        self._step_start = 0.0  # unix time the current engine step began (timeline)
        self.receiver = self.transport = None
        self.address: str | None = None
        self.prefix_info = self.llm.prefix_cache.info() if self.llm.prefix_cache is not None else None
        if serve_kv:
            from kv_transfer.receiver import KVReceiver

            self.transport = make_transport(transport) if isinstance(transport, str) else transport
            self.receiver = KVReceiver(self.llm, receiver_config, on_end=self._on_end)
            self.address = self.receiver.serve(self.transport)
        self.closed = False

    # ---- commands (the loop thread) ----------------------------------------------------------
    def reserve(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                lease_s: float = 30.0) -> TransferDescriptor | None:
        """Hold pages for the prompt's KV; None when this worker cannot admit it now."""
        assert self.receiver is not None, "a colocated worker takes add_request(), not reserve()"
        s, n = self.llm.scheduler, len(prompt_ids)
        self.llm.check_request(n, params)  # InvalidRequestError now, not when the KV arrives
        busy = len(s.running) + len(s.waiting) + self.receiver.num_live
        caching = self.llm.prefix_cache is not None  # then cached prefix pages count as held, not needed
        if s.waiting or busy >= s.cfg.max_num_seqs or (
                not caching and self.llm.tables.pages_for(n) > self.llm.allocator.num_free):
            return None
        try:  # with the prefix cache on, the allocator shares the cached prefix and says if the rest fits
            desc = self.receiver.reserve(n, params, request_id, lease_s, list(prompt_ids) if caching else None)
        except OutOfPagesError:
            return None
        self._entries[request_id] = _Entry(list(prompt_ids), params, desc.reservation_id, {})
        self._by_reservation[desc.reservation_id] = request_id
        return desc

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Run a request from its prompt here (colocated mode; the engine admits it by free pages)."""
        self.llm.add_request(list(prompt_ids), params, request_id=request_id)
        self._entries[request_id] = _Entry(list(prompt_ids), params, None, {})

    def fail_transfer(self, request_id: str, reason: str) -> None:
        """The prefill side gave up on this request's KV: end the reservation now (the failure policy
        applies) instead of waiting for its lease to lapse."""
        e = self._entries.get(request_id)
        if e is not None and e.reservation_id is not None and self.receiver is not None:
            self.receiver.cancel(e.reservation_id, f"prefill side: {reason}")

    def abort(self, request_id: str) -> None:
        """Free everything of `request_id`: its reservation or its running request (idempotent)."""
        e = self._entries.pop(request_id, None)
        if e is not None and e.reservation_id is not None:
            self._by_reservation.pop(e.reservation_id, None)
            self.receiver.cancel(e.reservation_id, "aborted")
        self.llm.abort(request_id)

    def has_work(self) -> bool:
        return self.llm.has_unfinished() or bool(self.receiver and self.receiver.num_live) or bool(self._failed)

    def prefix_hashes(self) -> list[bytes]:
        """Chain hashes of every page this engine's prefix cache holds (the router refreshes its index)."""
        return self.llm.prefix_cache.hashes() if self.llm.prefix_cache is not None else []

    def step(self) -> list[DecodeDelta]:
        """Pump transfers, handle failed ones, run one engine step; the deltas."""
        if self.receiver is not None:
            committed, now = self.receiver.pump(), time.time()
            for rid in committed:
                e = self._entries.get(rid)
                if e is not None and e.times is not None:
                    e.times["transfer_commit"] = now
            self._handle_failures()
        steps, self._step_start = self.llm.scheduler.stats.num_steps, time.time()
        outs = self.llm.step() if self.llm.has_unfinished() else []
        if self.receiver is None:  # colocated: this engine prefills too; stamp the step that started each prompt
            for r in self.llm.scheduler.running:
                e = self._entries.get(r.request_id)
                if e is not None and e.times is not None and r.num_computed and "prefill_start" not in e.times:
                    e.times["prefill_start"] = self._step_start
        if self.llm.scheduler.stats.num_steps == steps:  # nothing to compute: wait for the KV plane, not spin
            if self.receiver is not None:
                self.receiver.wait_for_work(0.002)
            else:
                time.sleep(0.002)
        deltas, self._pending = self._pending, []
        deltas += [self._delta(o) for o in outs]
        return deltas

    def stats(self) -> DecodeStats:
        s, u = self.llm.scheduler, self.llm.kv_usage()
        out = DecodeStats(self.llm.allocator.num_free, u["num_pages"], u["pages_in_use"], u["reservations"],
                          self.receiver.num_live if self.receiver else 0, len(s.running), len(s.waiting),
                          s.cfg.max_num_seqs, s.stats.num_preemptions, s.stats.num_steps,
                          self.num_transfer_failures, self.kv_bytes_received, self.transfers_committed,
                          self.llm.num_evicted_tokens)
        sp = self.llm.spec_stats()
        if sp:
            out.spec_steps, out.spec_share = int(sp["num_steps"]), sp["spec_share"]
            out.spec_drafted, out.spec_accepted = int(sp["num_drafted"]), int(sp["num_accepted"])
            out.spec_acceptance_rate, out.spec_tokens_per_verify = sp["acceptance_rate"], sp["tokens_per_verify"]
            out.spec_verify_cost_ratio, out.spec_draft_token_cost = sp["verify_cost_ratio"], sp["verify_token_cost"]
        px = self.llm.prefix_stats()
        if px:
            out.prefix_shared_received_pages, out.kv_bytes_not_received = (int(px["shared_received_pages"]),
                                                                           int(px["kv_bytes_not_received"]))
            out.prefix_queried_tokens, out.prefix_hit_tokens = int(px["queried_tokens"]), int(px["hit_tokens"])
            out.prefix_hit_rate, out.prefix_cached_pages = px["hit_rate"], int(px["cached_pages"])
        return out

    def close(self) -> None:
        """Stop receiving, fail live transfers, abort every request (their pages return to the pool)."""
        if self.closed:
            return
        self.closed = True
        if self.receiver is not None:
            self.receiver.close()
            self.transport.close()
        for rid in list(self.llm.requests):
            self.llm.abort(rid)
        self._entries.clear()
        self._by_reservation.clear()
        self.llm.close()  # TP/PP: the rank processes leave with the worker (no-op in one process)

    # ---- internals ---------------------------------------------------------------------------
    def _on_end(self, reservation_id: str, status: TransferStatus) -> None:
        """Receiver observer (any thread, receiver lock held): just record failures for the loop thread."""
        if status.state == TransferState.FAILED:
            with self._failed_lock:
                self._failed.append((reservation_id, status))
        elif status.state == TransferState.DONE:  # (committed, on the engine thread inside pump())
            self.kv_bytes_received += status.bytes
            self.transfers_committed += 1
            e = self._entries.get(self._by_reservation.get(reservation_id, ""))
            if e is not None:
                e.kv_bytes = status.bytes

    def _handle_failures(self) -> None:
        with self._failed_lock:
            failed, self._failed = list(self._failed), deque()
        for res_id, status in failed:
            rid = self._by_reservation.pop(res_id, None)
            e = self._entries.get(rid) if rid is not None else None
            if e is None or e.reservation_id != res_id:
                continue  # aborted by the router: nothing to report
            e.reservation_id = None
            self.num_transfer_failures += 1
            why = f"KV transfer failed: {status.reason or status.state.value}"
            if self.failure_policy == "recompute":
                try:
                    self.llm.add_request(e.prompt_ids, e.params, request_id=rid)
                    continue
                except PdserveError as err:  # (validated at reserve; never expected)
                    why += f"; recompute refused: {err}"
            del self._entries[rid]
            self._pending.append(DecodeDelta(rid, [], "", 0, 0, True, "error", error=why))

    def _delta(self, out: RequestOutput) -> DecodeDelta:
        e = self._entries.get(out.request_id)
        if e is not None and e.reservation_id is not None:  # the transfer committed: it runs here now
            self._by_reservation.pop(e.reservation_id, None)
            e.reservation_id = None
        times = None
        if e is not None and e.times is not None:
            times, e.times = e.times, None
            times["decode_admitted"] = self._step_start
            if self.receiver is None:  # colocated: the first output ends the prefill
                times.setdefault("prefill_start", self._step_start)
                times["prefill_end"] = time.time()
        kv = None
        if out.finished:
            self._entries.pop(out.request_id, None)
            kv = {"kv_pages": self.llm.tables.peak_pages(out.request_id)}
            if e is not None and e.kv_bytes is not None:
                kv["kv_bytes"] = e.kv_bytes
        logprobs = None
        if out.logprobs is not None:
            k = len(out.new_token_ids)
            logprobs = [(t.token_id, t.logprob, list(t.top_logprobs or [])) for t in out.logprobs[-k:]] if k else []
        return DecodeDelta(out.request_id, list(out.new_token_ids), out.new_text, len(out.token_ids), len(out.text),
                           out.finished, out.finish_reason, logprobs, out.num_preemptions, times=times, kv=kv)
