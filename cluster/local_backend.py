"""`LocalEngineBackend`: one in-process `engine.LLM` behind the `ServingBackend` contract.

Who calls it: the HTTP frontend (`cluster/http/`), `pdserve generate` and tests. The engine is
single-threaded, so one background thread owns it: every engine call (add_request, abort, step) happens
there, driven by a command queue. Life of a request:

    generate(req)  [event loop]     -> limit check (OverloadedError), "queued" timeline event, ("add", stream)
    engine thread                   -> llm.add_request (InvalidRequestError goes back to the caller),
                                       then llm.step() while anything runs; each RequestOutput becomes a
                                       GenerateDelta put on the request's asyncio.Queue with
                                       loop.call_soon_threadsafe; deadlines checked after every step
                                       (abort + a final delta with finish_reason "timeout")
    generate() exits early (client gone, task cancelled) -> ("abort", id) -> llm.abort frees its pages

Text: the engine holds back incomplete UTF-8 characters and any tail that may still become a stop string
(engine/outputs.py), so the engine's `text` only grows and concatenated deltas equal the final text.

Queue limit: `max_queued` bounds requests accepted but without a first token yet (waiting in the command
queue or the engine's scheduler); running requests do not count. `pause()`/`resume()` hold the engine
thread between steps (tests build deterministic queue states with it; a drain could use it too).
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

from cluster.serving_api import BackendStats, BackendUnavailableError, GenerateDelta, GenerateRequest, \
    OverloadedError
from engine.errors import InvalidRequestError, PdserveError, UnknownModelError

_STOP = object()  # command queue sentinel


@dataclass
class _Stream:
    """Per-request state shared by the engine thread (writer) and the caller's event loop (reader)."""
    req: GenerateRequest
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    deadline: float  # time.monotonic() value
    timeline: dict[str, float] = field(default_factory=dict)
    sent_chars: int = 0
    sent_tokens: int = 0
    prompt_tokens: int = 0
    preemptions: int = 0
    started: bool = False  # has produced its first token (no longer counts as queued)
    done: bool = False

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening any more
            pass


class LocalEngineBackend:
    def __init__(self, llm, max_queued: int = 256, default_timeout_s: float = 120.0,
                 model_name: str | None = None, clock=time.monotonic):
        self.llm = llm
        given = getattr(llm, "model_name", None)  # a bundled name or Hub id as given; a path: its folder's name
        self.model_name = model_name or (given if given and not Path(given).expanduser().exists()
                                         else Path(llm.model_dir).name)
        self.max_queued = max_queued
        self.default_timeout_s = default_timeout_s
        self.clock = clock
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _streams membership and the counters below
        self._streams: dict[str, _Stream] = {}
        self._queued = 0
        self._preemptions = 0
        self._ended = {"aborted": 0, "timed_out": 0}  # requests the backend ended early, by reason
        self._pages = (0, llm.kv_usage()["num_pages"])  # snapshot written by the engine thread
        self._spec: dict[str, float] = {}  # speculation counters (engine thread's snapshot; {} when off)
        self._gate = threading.Event()
        self._gate.set()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="pdserve-engine", daemon=True)
        self._thread.start()

    # ---- ServingBackend ----------------------------------------------------------------------
    def tokenizer(self):
        return self.llm.tokenizer

    async def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        stream = self._admit(req)
        try:
            while True:
                item = await stream.out.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not stream.done:  # the consumer left early: free the engine's pages
                self._cmds.put(("abort", req.request_id))

    async def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id))

    async def stats(self) -> BackendStats:
        with self._lock:
            queued, running = self._queued, len(self._streams) - self._queued
            preemptions = self._preemptions
            extra = {f"requests_{k}": float(v) for k, v in self._ended.items()}
        extra.update({f"spec_{k}": float(v) for k, v in self._spec.items()})
        in_use, total = self._pages
        return BackendStats(queued=queued, running=running, pages_in_use=in_use, num_pages=total,
                            preemptions=preemptions, extra=extra)

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.close)

    # ---- control -----------------------------------------------------------------------------
    def close(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; requests still in flight end with BackendUnavailableError."""
        if self._closed:
            return
        self._closed = True
        self._gate.set()
        self._cmds.put(_STOP)
        self._thread.join(timeout)

    def pause(self) -> None:
        self._gate.clear()

    def resume(self) -> None:
        self._gate.set()

    # ---- caller side -------------------------------------------------------------------------
    def _admit(self, req: GenerateRequest) -> _Stream:
        if self._closed:
            raise BackendUnavailableError("the backend is shut down")
        if req.model != self.model_name:
            raise UnknownModelError(req.model, f"this server serves {self.model_name!r}")
        timeout = req.deadline_s if req.deadline_s is not None else self.default_timeout_s
        stream = _Stream(req, asyncio.get_running_loop(), asyncio.Queue(), self.clock() + timeout)
        with self._lock:
            if self._queued >= self.max_queued:
                raise OverloadedError(f"{self._queued} requests are queued (limit {self.max_queued}); retry later")
            if req.request_id in self._streams:
                raise InvalidRequestError("request_id", f"{req.request_id!r} is already in flight")
            self._streams[req.request_id] = stream
            self._queued += 1
        stream.timeline["queued"] = time.time()
        self._cmds.put(("add", stream))
        return stream

    # ---- engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            self._gate.wait()
            idle = not self.llm.has_unfinished()
            if not self._drain(block=idle):
                break
            self._gate.wait()
            if self.llm.has_unfinished():
                self._step()
            self._expire()
            usage = self.llm.kv_usage()
            self._pages = (usage["pages_in_use"], usage["num_pages"])
            self._spec = self.llm.spec_stats() if hasattr(self.llm, "spec_stats") else {}
        for rid in self._live_ids():  # shut down with requests in flight: free their pages first
            self.llm.abort(rid)
        self._fail_all(BackendUnavailableError("the backend shut down"))

    def _drain(self, block: bool) -> bool:
        """Apply queued commands; False once told to stop."""
        try:
            cmd = self._cmds.get(timeout=0.5) if block else self._cmds.get_nowait()
        except queue.Empty:
            return True
        while True:
            if cmd is _STOP:
                return False
            kind, arg = cmd
            if kind == "add":
                self._add(arg)
            else:
                self._abort(arg, "abort")
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return True

    def _add(self, stream: _Stream) -> None:
        req = stream.req
        if stream.done:
            return
        try:
            self.llm.add_request(req.prompt, req.params, request_id=req.request_id)
        except PdserveError as e:
            self._end(stream, e)
            return
        stream.timeline["engine_added"] = time.time()

    def _abort(self, request_id: str, reason: str) -> None:
        stream = self._streams.get(request_id)
        self.llm.abort(request_id)  # no-op if the engine already finished it
        if stream is None or stream.done:
            return
        with self._lock:
            self._ended["timed_out" if reason == "timeout" else "aborted"] += 1
        stream.timeline["finish"] = time.time()
        self._end(stream, GenerateDelta(request_id, [], "", finished=True, finish_reason=reason,
                                        prompt_tokens=stream.prompt_tokens, completion_tokens=stream.sent_tokens,
                                        timeline=dict(stream.timeline) if stream.req.return_timeline else None))

    def _step(self) -> None:
        try:
            outs = self.llm.step()
        except Exception as e:  # noqa: BLE001 - an engine bug must not hang every caller
            err = BackendUnavailableError(f"engine step failed: {type(e).__name__}: {e}")
            for rid in self._live_ids():
                self.llm.abort(rid)
            self._fail_all(err)
            return
        for out in outs:
            stream = self._streams.get(out.request_id)
            if stream is not None and not stream.done:
                self._deliver(stream, out)

    def _deliver(self, stream: _Stream, out) -> None:
        now = time.time()
        if not stream.started and out.token_ids:
            stream.started = True
            stream.timeline["first_token"] = now
            with self._lock:
                self._queued -= 1
        if out.num_preemptions > stream.preemptions:
            with self._lock:
                self._preemptions += out.num_preemptions - stream.preemptions
            stream.preemptions = out.num_preemptions
        stream.prompt_tokens = len(out.prompt_token_ids)
        text = out.text
        new_text = text[stream.sent_chars:] if len(text) > stream.sent_chars else ""
        new_ids = out.token_ids[stream.sent_tokens:]
        logprobs = None
        if out.logprobs is not None:
            logprobs = [(t.token_id, t.logprob, list(t.top_logprobs or []))
                        for t in out.logprobs[stream.sent_tokens:]]
        stream.sent_chars = max(stream.sent_chars, len(text))
        stream.sent_tokens = len(out.token_ids)
        if out.finished:
            stream.timeline["finish"] = now
        delta = GenerateDelta(
            stream.req.request_id, new_ids, new_text, finished=out.finished, finish_reason=out.finish_reason,
            prompt_tokens=stream.prompt_tokens, completion_tokens=len(out.token_ids), logprobs=logprobs,
            timeline=dict(stream.timeline) if out.finished and stream.req.return_timeline else None)
        if out.finished:
            self._end(stream, delta)
        else:
            stream.put(delta)

    def _expire(self) -> None:
        now = self.clock()
        with self._lock:
            late = [rid for rid, s in self._streams.items() if not s.done and s.deadline <= now]
        for rid in late:
            self._abort(rid, "timeout")

    def _end(self, stream: _Stream, last) -> None:
        """The one place a request ends: final item out, counters and membership cleaned."""
        stream.done = True
        with self._lock:
            self._streams.pop(stream.req.request_id, None)
            if not stream.started:
                self._queued -= 1
        stream.put(last)

    def _live_ids(self) -> list[str]:
        with self._lock:
            return list(self._streams)

    def _fail_all(self, err: PdserveError) -> None:
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            if not stream.done:
                self._end(stream, err)
