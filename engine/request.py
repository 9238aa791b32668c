"""`Request`: one generation request's state as the scheduler sees it (pure Python).

Life cycle: WAITING -> RUNNING (prefill chunks, then decode) -> FINISHED; a preempted request goes back to
WAITING with its outputs kept and is recomputed from prompt + outputs; a prefill-only request ends its
prefill HELD, its pages kept until released. `token_ids` is prompt + outputs; `num_computed` counts the
tokens whose KV is in the cache.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    HELD = "held"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    arrival_time: float
    prefill_only: bool = False
    token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[SampledToken] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    first_token_time: float | None = None
    num_preemptions: int = 0
    logits: list = field(default_factory=list)  # per sampled token, only when the engine keeps logits

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
