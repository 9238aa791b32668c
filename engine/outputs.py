"""`RequestOutput` and the output processor: detokenization and stop strings.

The LLM calls `OutputProcessor.process` after each scheduler update for every request that got a token;
it decodes the output so far, cuts the text at the first stop string (and finishes the request through
the scheduler), and builds the `RequestOutput` a caller or a stream sees.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import Request
from engine.sampler import SampledToken


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # all output tokens so far
    text: str
    finished: bool
    finish_reason: str | None = None
    new_token_ids: list[int] = field(default_factory=list)  # tokens added since the previous output
    logprobs: list[SampledToken] | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    num_preemptions: int = 0
    logits: list | None = None  # float32 [vocab] per output token, when the engine keeps logits


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._sent: dict[str, int] = {}  # request id -> output tokens already reported

    def text_of(self, req: Request) -> tuple[str, bool]:
        """Decoded output, cut at the first stop string; second value says whether one was hit."""
        text = self.tokenizer.decode(req.output_token_ids, req.params.skip_special_tokens)
        cut = min((i for i in (text.find(s) for s in req.params.stop) if i >= 0), default=-1)
        return (text[:cut], True) if cut >= 0 else (text, False)

    def make_output(self, req: Request, text: str) -> RequestOutput:
        sent = self._sent.get(req.request_id, 0)
        out_ids = req.output_token_ids
        self._sent[req.request_id] = len(out_ids)
        if req.finished:
            self._sent.pop(req.request_id, None)
        return RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, token_ids=list(out_ids),
            text=text, finished=req.finished, finish_reason=req.finish_reason,
            new_token_ids=list(out_ids[sent:]),
            logprobs=list(req.output_logprobs) if req.params.logprobs is not None else None,
            arrival_time=req.arrival_time, first_token_time=req.first_token_time,
            num_preemptions=req.num_preemptions, logits=list(req.logits) if req.logits else None,
        )
