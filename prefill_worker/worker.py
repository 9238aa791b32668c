"""`PrefillWorker`: one prefill engine (`engine.LLM`) and its `KVSender`, driven by a plain step loop.

Who calls it: `cluster/serving/actors.py` runs it on one thread of a Ray actor (tests run it in-process); every
method runs on that thread. Life of a request here (docs/design.md "Life of a request", steps 4-5):

    submit(rid, prompt_ids, params, descriptor, decode_address)
        -> llm.add_request(prefill_only=True); sender.send(): each layer's KV is published as it is computed
    step()  = sender.step() (one engine step, then poll) -> events:
        PrefillEvent("first_token")      the prefill ended HELD: first token (+ text, logprob), prompt ids
        PrefillEvent("finished")         the request ended at its first token (EOS, max_tokens=1, stop
                                         string): nothing is left to decode; the caller frees the decode side
        PrefillEvent("transfer_done" | "transfer_failed")   the push ended; the held pages are released
    cancel(rid)  -> abort the transfer and the prefill (pages released at once; idempotent)

The engine batches waiting prompts by its token budget (`max_num_batched_tokens`) and admits them by free
pages. `stats()` reports the queued prefill tokens the router balances on, and the KV bytes shipped.
Prefix caching (`EngineConfig.enable_prefix_caching`): a prompt starts after the longest prefix this
engine has cached (prefill tokens saved), and only the KV from the descriptor's `kv_start` on is shipped
(the decode side holds the rest); `stats()` counts `prefix_*`, `prefill_tokens_saved` and the bytes not
sent; `prefix_info` lets the router name this engine's pages (`PrefixCache.info()`).

Timeline (unix seconds, in `PrefillEvent.times`; the router folds them into the request's timeline):
prefill_start (the step that first computed the prompt began; layer-wise publishing starts inside it, so it
is also transfer_start), prefill_end (the first token was sampled), transfer_done (the receiver acked).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.engine_config import EngineConfig
from engine.errors import PdserveError
from engine.llm import LLM
from engine.outputs import RequestOutput
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams
from kv_transfer.config import SenderConfig
from kv_transfer.contract import (TransferDescriptor, TransferState, TransferStatus, UnknownReservation,
                                  make_transport)

__all__ = ["PrefillWorker", "PrefillEvent", "PrefillStats"]


@dataclass
class PrefillEvent:
    request_id: str
    kind: str  # "first_token" | "finished" | "transfer_done" | "transfer_failed"
    token_ids: list[int] = field(default_factory=list)  # the first token (first_token / finished)
    text: str = ""  # its text (may be "" while a multi-byte character is incomplete)
    finish_reason: str | None = None  # finished: "stop" | "length"
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    prompt_token_ids: list[int] | None = None
    reason: str | None = None  # transfer_failed: why
    times: dict[str, float] | None = None  # timeline events this event settles (see the module map)


@dataclass
class PrefillStats:
    queued_prefill_tokens: int = 0  # prompt tokens not yet computed (waiting + running)
    waiting: int = 0
    running: int = 0
    held: int = 0  # prefilled, KV still leaving
    sending: int = 0  # live transfers
    pages_in_use: int = 0
    num_pages: int = 0
    reservations: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    kv_bytes_sent: int = 0  # KV payload bytes of ended transfers
    kv_transfer_seconds: float = 0.0  # summed transfer_start -> transfer end of ended transfers
    transfers_done: int = 0
    transfers_failed: int = 0
    kv_evicted_tokens: int = 0  # prompt tokens whose KV eviction dropped (never sent)
    # prefix caching (0 when off)
    prefix_queried_tokens: int = 0  # prompt tokens looked up in this engine's prefix cache
    prefix_hit_tokens: int = 0  # of those, found cached
    prefix_hit_rate: float = 0.0
    prefill_tokens_saved: int = 0  # = hit tokens: prompt tokens not computed
    prefix_cached_pages: int = 0
    kv_tokens_not_sent: int = 0  # prompt tokens of done transfers the decode side held already (kv_start)
    kv_bytes_not_sent: int = 0  # their KV bytes (what shipping them would have cost)


class PrefillWorker:
    def __init__(self, engine: EngineConfig | dict, sender_config: SenderConfig | None = None, transport="grpc",
                 llm: LLM | None = None):
        """`engine`: the engine's config (or a dict of its fields); `transport`: a name in
        `kv_transfer.contract.TRANSPORTS` or a transport object (tests share one in-process `FakeTransport`
        between workers). `llm`: an engine built by the caller (tests)."""
        self.llm = llm if llm is not None else LLM(EngineConfig.of(engine))
        self.transport = make_transport(transport) if isinstance(transport, str) else transport
        from kv_transfer.sender import KVSender  # after the engine: the sender hooks into its runner

        self.sender = KVSender(self.llm, self.transport, sender_config, on_end=self._on_end)
        self._events: list[PrefillEvent] = []
        self._finished_early: set[str] = set()  # ended at their first token: their transfer abort is expected
        self._started: dict[str, float] = {}  # request id -> prefill_start (= transfer_start), until it ends
        self._totals = {"bytes": 0, "seconds": 0.0, "done": 0, "failed": 0, "not_sent": 0, "not_sent_bytes": 0}
        self._kv_start: dict[str, int] = {}  # request id -> its descriptor's kv_start, until the transfer ends
        self.prefix_info = self.llm.prefix_cache.info() if self.llm.prefix_cache is not None else None
        self.closed = False

    # ---- commands (the loop thread) ----------------------------------------------------------
    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
               descriptor: TransferDescriptor, decode_address: str) -> None:
        """Queue the prompt for prefill and ship its KV into `descriptor`'s pages at `decode_address`."""
        rid = self.llm.add_request(list(prompt_ids), params, request_id=request_id, prefill_only=True)
        try:
            self.sender.send(rid, descriptor, decode_address)
        except PdserveError:
            self.llm.abort(rid)
            raise
        self._kv_start[rid] = descriptor.kv_start

    def cancel(self, request_id: str) -> None:
        """Stop the prefill and its transfer, free its pages (no-op for an unknown or ended request)."""
        try:
            self.sender.status(request_id)
        except UnknownReservation:  # never sent (or long forgotten): only the engine may hold it
            self.llm.abort(request_id)
            self._started.pop(request_id, None)
        else:  # the sender releases the held pages / aborts the prefill once its push thread has stopped
            self.sender.cancel(request_id, "cancelled by the router")
        self._finished_early.discard(request_id)

    def has_work(self) -> bool:
        # (events count: a command can settle transfers -- `cancel` polls the sender -- and their reports go out
        # with the next step; without one they would wait for the next request, a flight held meanwhile)
        return self.llm.has_unfinished() or self.sender.num_live > 0 or bool(self._events)

    def prefix_hashes(self) -> list[bytes]:
        """Chain hashes of every page this engine's prefix cache holds (the router refreshes its index)."""
        return self.llm.prefix_cache.hashes() if self.llm.prefix_cache is not None else []

    def step(self) -> list[PrefillEvent]:
        """One engine step (or, with only transfers in flight, a short wait and a poll); the events."""
        steps, t0 = self.llm.scheduler.stats.num_steps, time.time()
        outs = self.llm.step() if self.llm.has_unfinished() else []
        for r in self.llm.scheduler.running:
            if r.num_computed and r.request_id not in self._started:
                self._started[r.request_id] = t0  # (still chunking: the first step that computed it)
        for out in outs:
            self._started.setdefault(out.request_id, t0)
            self._on_output(out)  # (= sender.step(), with the outputs seen before the poll)
        if self.llm.scheduler.stats.num_steps == steps:
            time.sleep(0.001)  # nothing to compute (push threads working, or no free pages): do not spin
        self.sender.poll()
        events, self._events = self._events, []
        return events

    def stats(self) -> PrefillStats:
        s = self.llm.scheduler
        queued = sum(len(r.token_ids) - r.num_computed for r in [*s.waiting, *s.running])
        u = self.llm.kv_usage()
        t = self._totals
        out = PrefillStats(queued, len(s.waiting), len(s.running), len(s.held), self.sender.num_live,
                           u["pages_in_use"], u["num_pages"], u["reservations"], s.stats.num_preemptions,
                           s.stats.num_steps, t["bytes"], t["seconds"], t["done"], t["failed"],
                           self.llm.num_evicted_tokens, kv_tokens_not_sent=t["not_sent"],
                           kv_bytes_not_sent=t["not_sent_bytes"])
        px = self.llm.prefix_stats()
        if px:
            out.prefix_queried_tokens, out.prefix_hit_tokens = int(px["queried_tokens"]), int(px["hit_tokens"])
            out.prefix_hit_rate, out.prefill_tokens_saved = px["hit_rate"], int(px["prefill_tokens_saved"])
            out.prefix_cached_pages = int(px["cached_pages"])
        return out

    def close(self) -> None:
        """Abort every transfer and prefill, stop the push threads and the transport."""
        if self.closed:
            return
        self.closed = True
        self.sender.close()
        for rid in list(self.llm.requests):
            self.llm.abort(rid)
        self.transport.close()
        self.llm.close()  # TP/PP: the rank processes leave with the worker (no-op in one process)

    # ---- internals ---------------------------------------------------------------------------
    def _on_output(self, out: RequestOutput) -> None:
        """A prefill produced its first token: HELD (its KV is leaving) or finished right there."""
        logprobs = None
        if out.logprobs is not None:
            logprobs = [(t.token_id, t.logprob, list(t.top_logprobs or [])) for t in out.logprobs]
        held = self.llm.scheduler.held.get(out.request_id)
        start = self._started.get(out.request_id, time.time())
        times = {"prefill_start": start, "prefill_end": time.time()}
        if out.finished or held is None or held.status != RequestStatus.HELD:
            self._finished_early.add(out.request_id)
            self._events.append(PrefillEvent(out.request_id, "finished", list(out.token_ids), out.text,
                                             out.finish_reason or "stop", logprobs, list(out.prompt_token_ids),
                                             times=times))
            return
        times["transfer_start"] = start
        self._events.append(PrefillEvent(out.request_id, "first_token", list(out.token_ids), out.text, None,
                                         logprobs, list(out.prompt_token_ids), times=times))

    def _on_end(self, request_id: str, status: TransferStatus) -> None:
        """The sender settled a transfer (engine thread): count it, report it unless its abort was expected."""
        now, start = time.time(), self._started.pop(request_id, None)
        t = self._totals
        t["bytes"] += status.bytes
        kv_start = self._kv_start.pop(request_id, 0)
        if status.state == TransferState.DONE and kv_start:
            t["not_sent"] += kv_start
            t["not_sent_bytes"] += self.sender.layout.transfer_bytes(kv_start)
        t["seconds"] += now - start if start is not None else 0.0
        t["done" if status.state == TransferState.DONE else "failed"] += 1
        if request_id in self._finished_early:
            self._finished_early.discard(request_id)
            return
        if status.state == TransferState.DONE:
            self._events.append(PrefillEvent(request_id, "transfer_done", times={"transfer_done": now}))
        else:
            self._events.append(PrefillEvent(request_id, "transfer_failed", reason=status.reason))
