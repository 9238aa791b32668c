"""`Flight`: the router's record of one request in flight, and how worker events become `GenerateDelta`s;
`FlightTable`: every flight the router holds, by worker id and by client request id, and the admission FIFO.

Owned by `cluster/serving/router.py` (admission and recovery read and change the table it passes them);
pure Python (no Ray, no torch). Events reach a flight from two workers that
do not know about each other, in any order: the prefill worker's first token (`PrefillEvent`) and the
decode worker's deltas (`DecodeDelta`, whose first one usually repeats that first token, since the decode
engine's outputs start at it; after a failed transfer with policy "recompute" the decode worker regenerates
it). Each event says how many output tokens exist so far (`num_output`) and how long the text is
(`text_len`), so `Flight.advance()` streams exactly the tokens not yet sent -- none lost, none repeated --
and rebuilds the text from whichever view is newest. Text that may be the start of a stop string is held
back until the next token resolves it (the engine cuts the final text at the stop).

Recovery (`cluster/serving/recovery.py`): after a worker loss the flight runs again elsewhere as `run_prompt` (prompt
+ `output_ids`) under a new `wid`; `rebase()` makes the new workers' counts (which start at 0) continue the
client's stream: `base_tokens`/`base_chars` are added to every later event's `num_output`/`text_len`.
The new workers detokenize their outputs on their own, so the seam may lack a separator (a tokenizer
drops the leading space of a text's first token): `seam(first new ids)` gives the missing prefix once.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from cluster.serving_api import GenerateDelta, GenerateRequest
from engine.sampling_params import SamplingParams

Logprobs = list[tuple[int, float | None, list[tuple[int, float]]]]


def visible_text(text: str, stops: list[str], finished: bool) -> str:
    """`text` minus a trailing possible start of a stop string (kept until resolved)."""
    if finished or not stops:
        return text
    for k in range(min(max(len(s) for s in stops) - 1, len(text)), 0, -1):
        if any(s.startswith(text[-k:]) for s in stops):
            return text[:-k]
    return text


@dataclass
class Flight:
    req: GenerateRequest
    wid: str  # the id workers know it by (request id + a router counter: ids may be reused by clients)
    prompt_ids: list[int]
    params: SamplingParams  # validated, with a fixed seed (prefill and decode sample alike)
    deadline: float  # monotonic
    queue: object  # asyncio.Queue of worker events and router signals
    timeline: dict[str, float] = field(default_factory=dict)
    prefill: object = None  # router-side worker records (membership.Worker)
    decode: object = None
    prefill_open: bool = False  # the prefill worker may still hold pages or a transfer for it
    prefill_ended: bool = False  # a terminal prefill event arrived (possibly before submit() returned)
    decode_open: bool = False  # the decode worker holds a reservation or a running request for it
    prefill_tokens_counted: bool = False  # its prompt counts in its prefill worker's queued tokens
    prefill_tokens: int = 0  # how many: the prompt less the prefix the router expects cached there
    done: bool = False
    sent_tokens: int = 0
    seen_tokens: int = 0  # the newest num_output of any event
    text: str = ""  # the newest full output text
    sent_chars: int = 0
    output_ids: list[int] = field(default_factory=list)  # every token streamed (a resume re-prefills them)
    run_prompt: list[int] | None = None  # what workers run (prompt, or prompt + output_ids after a resume)
    run_params: SamplingParams | None = None
    base_tokens: int = 0  # output tokens / characters before the current placement (see rebase)
    base_chars: int = 0
    recoveries: int = 0
    seam: Callable[[list[int]], str] | None = None  # after a rebase, until the first new token arrives

    def __post_init__(self) -> None:
        if self.run_prompt is None:
            self.run_prompt, self.run_params = self.prompt_ids, self.params

    @property
    def queued(self) -> bool:
        """Counts against the queue limit: accepted, no token streamed yet, not ended."""
        return not self.done and self.sent_tokens == 0

    def uncount_prefill(self) -> None:
        """Its prompt no longer counts in its prefill worker's queued tokens (first token back, or it left)."""
        if self.prefill_tokens_counted:
            self.prefill_tokens_counted = False
            self.prefill.queued_tokens -= self.prefill_tokens

    def mark(self, event: str) -> None:
        self.timeline.setdefault(event, time.time())

    def advance(self, new_ids: list[int], num_output: int, new_text: str, text_len: int,
                logprobs: Logprobs | None = None, finished: bool = False,
                finish_reason: str | None = None) -> GenerateDelta | None:
        """Fold one event's view in; the delta to stream (None when it adds nothing)."""
        if self.seam is not None and new_ids and text_len == len(new_text):  # the new placement's first text
            prefix, self.seam = self.seam(new_ids[:1]), None
            self.base_chars += len(prefix)
            new_text = prefix + new_text
        num_output, text_len = num_output + self.base_tokens, text_len + self.base_chars
        if num_output < self.seen_tokens and not finished:
            return None  # an older view (the prefill's first token after the decode's first delta)
        if num_output >= self.seen_tokens:
            base = text_len - len(new_text)
            self.text = self.text[:base] + new_text if base <= len(self.text) else self.text
            self.seen_tokens = num_output
        k = num_output - self.sent_tokens
        ids = new_ids[len(new_ids) - k:] if 0 < k <= len(new_ids) else []
        lps = None
        if self.params.logprobs is not None:
            lps = list(logprobs[len(logprobs) - len(ids):]) if logprobs and ids else []
        shown = visible_text(self.text, self.params.stop, finished)
        chars = shown[self.sent_chars:] if len(shown) > self.sent_chars else ""
        if not ids and not chars and not finished:
            return None
        if ids and self.sent_tokens == 0:
            self.mark("first_token")
        self.sent_tokens += len(ids)
        self.output_ids += ids
        self.sent_chars = max(self.sent_chars, len(shown))
        if finished:
            self.done = True
            self.mark("finish")
        return GenerateDelta(self.req.request_id, ids, chars, finished, finish_reason if finished else None,
                             len(self.prompt_ids), self.sent_tokens, lps,
                             dict(self.timeline) if finished and self.req.return_timeline else None)

    def rebase(self, wid: str, run_prompt: list[int], run_params: SamplingParams,
               seam: Callable[[list[int]], str] | None = None) -> None:
        """Start a new placement: the workers' counts restart at 0 after what the client has seen."""
        assert len(self.output_ids) == self.sent_tokens, (self.wid, len(self.output_ids), self.sent_tokens)
        self.wid, self.run_prompt, self.run_params = wid, run_prompt, run_params
        self.base_tokens = self.seen_tokens = self.sent_tokens
        self.base_chars, self.seam = len(self.text), seam if self.output_ids else None
        self.prefill = self.decode = None
        self.prefill_open = self.prefill_ended = self.decode_open = self.prefill_tokens_counted = False
        self.recoveries += 1

    def final(self, reason: str) -> GenerateDelta:
        """The last delta of a request the router ends itself (timeout, abort)."""
        self.done = True
        self.mark("finish")
        return GenerateDelta(self.req.request_id, [], "", True, reason, len(self.prompt_ids), self.sent_tokens,
                             [] if self.params.logprobs is not None else None,
                             dict(self.timeline) if self.req.return_timeline else None)


class Inbox(asyncio.Queue):
    """A flight's queue of worker events and router signals; the router sees each item as it arrives
    (`on_arrival`), not when the client reads it, so a slow reader holds no resource other flights need."""

    def __init__(self, on_arrival: Callable[[Any], None]):
        super().__init__()
        self._on_arrival = on_arrival

    def put_nowait(self, item) -> None:
        self._on_arrival(item)
        super().put_nowait(item)


class FlightTable:
    """The router's flights: `by_wid` (the id workers know: request id + a counter, renewed by each
    recovery), `by_request` (the client's id), and `waiting` (not placed yet, in arrival order; a
    recovered flight goes back to its head). `wake` tells the admission loop that something changed."""

    def __init__(self):
        self.by_wid: dict[str, Flight] = {}
        self.by_request: dict[str, Flight] = {}
        self.waiting: list[Flight] = []
        self.wake = asyncio.Event()
        self._ids = itertools.count()

    def __len__(self) -> int:
        return len(self.by_wid)

    def get(self, wid: str) -> Flight | None:
        return self.by_wid.get(wid)

    def new_wid(self, request_id: str) -> str:
        return f"{request_id}#{next(self._ids)}"

    def queued(self) -> int:
        """Flights counting against the queue limit (accepted, no token streamed yet)."""
        return sum(f.queued for f in self.by_wid.values())

    def add(self, f: Flight) -> None:
        """A new flight joins the end of the queue."""
        self.by_wid[f.wid] = f
        self.by_request[f.req.request_id] = f
        self.waiting.append(f)
        self.wake.set()

    def remove(self, f: Flight) -> bool:
        """`f` leaves the table; False if it had left already."""
        if self.by_wid.pop(f.wid, None) is None:
            return False
        if self.by_request.get(f.req.request_id) is f:
            del self.by_request[f.req.request_id]
        if f in self.waiting:
            self.waiting.remove(f)
        self.wake.set()
        return True

    def requeue_first(self, f: Flight, rebase: Callable[[str], None]) -> None:
        """`f` is placed again, first in line, under a fresh wid (`rebase(wid)` moves the flight onto it)."""
        del self.by_wid[f.wid]
        rebase(self.new_wid(f.req.request_id))
        self.by_wid[f.wid] = f
        if f in self.waiting:
            self.waiting.remove(f)
        self.waiting.insert(0, f)
        self.wake.set()
