"""`RequestOutput` and the output processor: incremental detokenization and stop strings.

The LLM calls `OutputProcessor.advance` after each scheduler update for every request that got a token.
Text grows incrementally: only a short window of recent tokens is decoded each step (decoding the whole
output every step would cost O(length) per token), and a multi-byte character split across tokens is held
back until complete. Stop strings are searched only in the newly added text plus a tail as long as the
longest stop string; the text is cut at the first stop (after it, with `include_stop_str_in_output`)
and the LLM finishes the request. As vLLM, text of the first `min_tokens` tokens is not searched (a stop
may still begin in it and end later). Until the request finishes, a tail of the text that could still
become a stop string is held back from `text` and `new_text`, so a stream never shows part of a stop string.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import Request, SampledToken


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # all output tokens so far
    text: str
    finished: bool
    finish_reason: str | None = None
    new_token_ids: list[int] = field(default_factory=list)  # tokens added since the previous output
    new_text: str = ""  # text added since the previous output
    logprobs: list[SampledToken] | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    num_preemptions: int = 0
    logits: list | None = None  # float32 [vocab] per output token, when the engine keeps logits


@dataclass
class _DetokState:
    text: str = ""
    prefix_offset: int = 0  # decode window start (tokens before it only give context for spacing)
    read_offset: int = 0  # tokens before this are already in `text`
    sent_tokens: int = 0
    sent_chars: int = 0


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._state: dict[str, _DetokState] = {}

    def advance(self, req: Request) -> bool:
        """Fold new output tokens into the text; True if a stop string was hit (text already cut)."""
        st = self._state.setdefault(req.request_id, _DetokState())
        ids, skip = req.output_token_ids, req.params.skip_special_tokens
        if st.read_offset >= len(ids):
            return False
        before = self.tokenizer.decode(ids[st.prefix_offset:st.read_offset], skip)
        after = self.tokenizer.decode(ids[st.prefix_offset:], skip)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return False  # an incomplete character: wait for the next token
        old_len = len(st.text)
        st.text += after[len(before):]
        st.prefix_offset, st.read_offset = st.read_offset, len(ids)
        p = req.params
        if not p.stop or len(ids) <= p.min_tokens:
            return False
        start = max(0, old_len - max(len(s) for s in p.stop) + 1)
        hits = [(i, -len(s), s) for i, s in ((st.text.find(s, start), s) for s in p.stop) if i >= 0]
        if hits:
            i, _, stop = min(hits)  # the earliest; at one position the longest
            st.text = st.text[:i + len(stop) if p.include_stop_str_in_output else i]
            return True
        return False

    def make_output(self, req: Request) -> RequestOutput:
        st = self._state.setdefault(req.request_id, _DetokState())
        out_ids = req.output_token_ids
        text = st.text
        if req.finished and st.read_offset < len(out_ids):
            text = self.tokenizer.decode(out_ids, req.params.skip_special_tokens)  # flush held-back bytes
        if not req.finished:  # hold back a tail that may still grow into a stop string
            text = text[:len(text) - _stop_prefix_len(text, req.params.stop)]
        out = RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, token_ids=list(out_ids),
            text=text, finished=req.finished, finish_reason=req.finish_reason,
            new_token_ids=list(out_ids[st.sent_tokens:]), new_text=text[st.sent_chars:],
            logprobs=list(req.output_logprobs) if req.params.logprobs is not None else None,
            arrival_time=req.arrival_time, first_token_time=req.first_token_time,
            num_preemptions=req.num_preemptions, logits=list(req.logits) if req.logits else None,
        )
        st.sent_tokens, st.sent_chars = len(out_ids), len(text)
        if req.finished:
            del self._state[req.request_id]
        return out

    def forget(self, request_id: str) -> None:
        self._state.pop(request_id, None)


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best
