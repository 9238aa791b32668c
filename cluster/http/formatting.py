"""GenerateDelta -> OpenAI JSON: response bodies, stream chunks, logprobs, usage.

`handlers.py` creates one `Formatter` per HTTP request and one `ChoiceState` per choice, folds every
`GenerateDelta` into its choice (`ChoiceState.add`) and asks the formatter for the JSON it sends: a stream
chunk per delta (`chunk`), the chat role chunk, the usage chunk, or the whole non-streamed response
(`response`). Both paths format text from the same deltas, so concatenated stream text equals the
non-streamed text. Stream usage: `stream_options.include_usage` adds a last chunk (no choices) with the
request's usage, and every other chunk then carries `"usage": null` (OpenAI); `continuous_usage_stats`
(vLLM) puts on every chunk its choice's usage so far (prompt tokens, completion tokens, total).

pdserve extensions sit on each choice (the openai SDK keeps unknown fields): `token_ids` (option
`pdserve.return_token_ids`) and `timeline` (option `pdserve.timeline`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from cluster.serving_api import GenerateDelta

Kind = Literal["completion", "chat"]


@dataclass
class ChoiceState:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # (token id, logprob, [(id, logprob)]) per token
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    timeline: dict[str, float] | None = None
    text_offset: int = 0  # completions logprobs: offset of the next token's text

    def add(self, d: GenerateDelta) -> None:
        self.text += d.new_text
        self.token_ids += d.new_token_ids
        self.logprobs += d.logprobs or []
        self.prompt_tokens = d.prompt_tokens or self.prompt_tokens
        self.completion_tokens = max(self.completion_tokens, d.completion_tokens, len(self.token_ids))
        if d.finished:
            self.finish_reason = d.finish_reason
            self.timeline = d.timeline


class Formatter:
    def __init__(self, kind: Kind, response_id: str, model: str, created: int, tokenizer,
                 logprobs: bool, return_token_ids: bool, return_timeline: bool, include_usage: bool,
                 continuous_usage: bool = False):
        self.kind, self.id, self.model, self.created = kind, response_id, model, created
        self.tokenizer = tokenizer
        self.want_logprobs, self.want_ids, self.want_timeline = logprobs, return_token_ids, return_timeline
        self.include_usage, self.continuous_usage = include_usage, continuous_usage
        self._token_str: dict[int, str] = {}

    # ---- pieces ------------------------------------------------------------------------------
    def _decode1(self, tid: int) -> str:
        s = self._token_str.get(tid)
        if s is None:
            s = self._token_str[tid] = self.tokenizer.decode([tid], skip_special_tokens=False)
        return s

    def token_str(self, tid: int, prev: int | None = None) -> str:
        """The token's text as it appears after `prev` (decoders add spaces from context)."""
        if prev is None:
            return self._decode1(tid)
        both = self.tokenizer.decode([prev, tid], skip_special_tokens=False)
        head = self._decode1(prev)
        return both[len(head):] if both.startswith(head) else self._decode1(tid)

    def logprobs_block(self, entries: list, choice: ChoiceState, start: int = 0) -> dict | None:
        """OpenAI logprobs for `entries`, the choice's tokens from position `start` on."""
        if not self.want_logprobs:
            return None
        prevs = [choice.token_ids[i - 1] if i > 0 else None for i in range(start, start + len(entries))]
        if self.kind == "chat":
            return {"content": [self._chat_lp(tid, lp, top, prev) for (tid, lp, top), prev in zip(entries, prevs)],
                    "refusal": None}
        tokens = [self.token_str(tid, prev) for (tid, _, _), prev in zip(entries, prevs)]
        offsets = []
        for s in tokens:
            offsets.append(choice.text_offset)
            choice.text_offset += len(s)
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [{self.token_str(t, prev): v for t, v in top}
                                 for (_, _, top), prev in zip(entries, prevs)],
                "text_offset": offsets}

    def _chat_lp(self, tid: int, lp: float, top: list, prev: int | None) -> dict:
        def entry(t: int, v: float) -> dict:
            s = self.token_str(t, prev)
            return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8"))}
        return dict(entry(tid, lp), top_logprobs=[entry(t, v) for t, v in top])

    def _extensions(self, out: dict, token_ids: list[int], timeline: dict | None, finished: bool) -> dict:
        if self.want_ids:
            out["token_ids"] = list(token_ids)
        if self.want_timeline and finished:
            out["timeline"] = timeline
        return out

    @staticmethod
    def usage(choices: list[ChoiceState], prompt_groups: list[int]) -> dict:
        seen, prompt = set(), 0
        for c, group in zip(choices, prompt_groups):
            if group not in seen:  # n choices of one prompt count its tokens once
                seen.add(group)
                prompt += c.prompt_tokens
        completion = sum(c.completion_tokens for c in choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    # ---- stream chunks -----------------------------------------------------------------------
    def _envelope(self, choices: list[dict], usage: dict | None = None) -> dict:
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if self.kind == "chat":
            out["system_fingerprint"] = None
        if self.include_usage or self.continuous_usage:
            out["usage"] = usage if self.continuous_usage else None
        return out

    @staticmethod
    def _so_far(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def role_chunk(self, index: int, prompt_tokens: int = 0) -> dict:
        return self._envelope([{"index": index, "delta": {"role": "assistant", "content": ""},
                                "logprobs": None, "finish_reason": None}], self._so_far(prompt_tokens, 0))

    def chunk(self, choice: ChoiceState, d: GenerateDelta) -> dict | None:
        """The stream chunk for one delta (None when it carries nothing a client would see)."""
        if not d.new_text and not d.finished and not (d.new_token_ids and (self.want_ids or self.want_logprobs)):
            return None
        lp = self.logprobs_block(d.logprobs or [], choice, len(choice.token_ids) - len(d.new_token_ids))
        if self.kind == "completion":
            c = {"index": choice.index, "text": d.new_text, "logprobs": lp, "finish_reason": d.finish_reason}
        else:
            c = {"index": choice.index, "delta": {"content": d.new_text} if d.new_text else {},
                 "logprobs": lp, "finish_reason": d.finish_reason}
        return self._envelope([self._extensions(c, d.new_token_ids, d.timeline, d.finished)],
                              self._so_far(choice.prompt_tokens, choice.completion_tokens))

    def usage_chunk(self, choices: list[ChoiceState], prompt_groups: list[int]) -> dict:
        out = self._envelope([])
        out["usage"] = self.usage(choices, prompt_groups)
        return out

    # ---- whole response ----------------------------------------------------------------------
    def response(self, choices: list[ChoiceState], prompt_groups: list[int]) -> dict:
        body = []
        for c in choices:
            lp = self.logprobs_block(c.logprobs, c)
            if self.kind == "completion":
                item = {"index": c.index, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason}
            else:
                item = {"index": c.index, "message": {"role": "assistant", "content": c.text, "refusal": None},
                        "logprobs": lp, "finish_reason": c.finish_reason}
            body.append(self._extensions(item, c.token_ids, c.timeline, True))
        obj = "text_completion" if self.kind == "completion" else "chat.completion"
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": body,
               "usage": self.usage(choices, prompt_groups)}
        if self.kind == "chat":
            out["system_fingerprint"] = None
        return out
