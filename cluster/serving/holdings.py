"""`Holdings`: what workers hold for a flight, and how the router lets go of it. Pure Python, no Ray.

Who calls it: admission (takes a KV receive stream before a submit; `cancel_prefill` when a submit comes
back void), the router (`release` when a flight ends, `free_stream` when a push ends) and recovery
(`release` before a harmed flight is placed again). What a flight may hold:
  - on its decode (or colocated) worker: a reservation or a running request -> `abort`;
  - on its prefill worker: a queued prompt, held prefill pages, a push in progress -> `cancel`;
  - on the router: its prompt in its prefill worker's queued tokens (`Flight.uncount_prefill`) and one of
    its decode worker's KV receive streams.
Cleanup calls are fire-and-forget beside the loop (`Tasks.spawn`): a dead worker has nothing left to free.

KV receive streams: a push opens when its prompt's first layer is computed (`KVSender`), and a decode
worker's gRPC server refuses pushes beyond its `max_streams` (8): a prefill batch of up to max_num_seqs
prompts plus those still shipping (from several prefill workers) can pass that, and each refused push is a
failed transfer (under policy "fail" a failed request). So a submit first takes one of its decode worker's
`kv_streams_per_decode` streams (`acquire_stream`, FIFO); the push's end frees it as the event arrives
(`on_arrival`, from the flight's `Inbox`, not when the client reads it), or the cancel that stops the push
does (`cancel_prefill`).
"""
from __future__ import annotations

import asyncio

from cluster.serving.flight import Flight
from cluster.serving.membership import Worker
from cluster.serving.tasks import Tasks
from engine.errors import PdserveError
from prefill_worker.worker import PrefillEvent

PUSH_ENDS = ("finished", "transfer_done", "transfer_failed")  # prefill events sent after its push closed


class Holdings:
    def __init__(self, tasks: Tasks, streams_per_decode: int):
        self._tasks = tasks
        self._per_decode = max(1, streams_per_decode)
        self.streams: dict[Worker, asyncio.Semaphore] = {}  # decode worker -> its free KV receive streams
        self.slots: dict[str, asyncio.Semaphore] = {}  # wid -> the stream its push holds

    # ---- cleanup calls ---------------------------------------------------------------------------
    async def call(self, w: Worker, method: str, *args) -> None:
        """Fire-and-forget cleanup: a dead worker has nothing left to free."""
        if not w.alive:
            return
        try:
            await w.handle.call(method, *args)
        except PdserveError:
            pass

    async def cancel_prefill(self, p: Worker, wid: str) -> None:
        """Cancel `wid` on prefill worker `p`; its decode stream is free once `p` took the cancel (which
        stops the push) or is dead."""
        try:
            await self.call(p, "cancel", wid)
        finally:
            self.free_stream(wid)

    def release(self, f: Flight) -> None:
        """Let go of whatever `f`'s current placement holds on its workers (see the module map)."""
        f.uncount_prefill()
        if f.decode is not None and f.decode_open:
            f.decode_open = False
            self._tasks.spawn(self.call(f.decode, "abort", f.wid))
        if f.prefill is not None and f.prefill_open:
            f.prefill_open = False
            self._tasks.spawn(self.cancel_prefill(f.prefill, f.wid))

    # ---- KV receive streams ----------------------------------------------------------------------
    def stream_of(self, w: Worker) -> asyncio.Semaphore:
        return self.streams.setdefault(w, asyncio.Semaphore(self._per_decode))

    def hold_stream(self, wid: str, stream: asyncio.Semaphore) -> None:
        """`wid`'s push holds `stream` until the push ends (`on_arrival`) or is cancelled."""
        self.slots[wid] = stream

    def on_arrival(self, item) -> None:
        if isinstance(item, PrefillEvent) and item.kind in PUSH_ENDS:
            self.free_stream(item.request_id)

    def free_stream(self, wid: str) -> None:
        stream = self.slots.pop(wid, None)
        if stream is not None:
            stream.release()

    def forget(self, w: Worker) -> None:
        """`w` takes no new push (fenced or left): drop its counter (a submit waiting on it keeps its own
        reference and finds its flight re-placed)."""
        self.streams.pop(w, None)
