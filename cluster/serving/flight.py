"""`Flight`: the router's record of one request in flight, and how worker events become `GenerateDelta`s.

Owned by `cluster/router.py`; pure Python (no Ray, no torch). Events reach a flight from two workers that
do not know about each other, in any order: the prefill worker's first token (`PrefillEvent`) and the
decode worker's deltas (`DecodeDelta`, whose first one usually repeats that first token, since the decode
engine's outputs start at it; after a failed transfer with policy "recompute" the decode worker regenerates
it). Each event says how many output tokens exist so far (`num_output`) and how long the text is
(`text_len`), so `Flight.advance()` streams exactly the tokens not yet sent -- none lost, none repeated --
and rebuilds the text from whichever view is newest. Text that may be the start of a stop string is held
back until the next token resolves it (the engine cuts the final text at the stop).

Recovery (`cluster/recovery.py`): after a worker loss the flight runs again elsewhere as `run_prompt` (prompt
+ `output_ids`) under a new `wid`; `rebase()` makes the new workers' counts (which start at 0) continue the
client's stream: `base_tokens`/`base_chars` are added to every later event's `num_output`/`text_len`.
The new workers detokenize their outputs on their own, so the seam may lack a separator (a tokenizer
drops the leading space of a text's first token): `seam(first new ids)` gives the missing prefix once.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

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
    prefill: object = None  # router-side worker records (router.Worker)
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
