"""Step batch and step output: the plain dataclasses between a scheduler and `ModelRunner`.

Each sequence brings any number of new tokens (a prompt, a prefill chunk, one decode token, or 1 + k
draft tokens to verify), its page table and slot count, the positions of its new tokens, where it wants
logits, and whether to sample.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.attention_context import ObserveSpec
from engine.request import SampledToken
from engine.sampler import SampleRequest


@dataclass
class SeqStep:
    request_id: str
    token_ids: list[int]  # new tokens this step
    position_start: int  # logical position of token_ids[0]; later ones follow contiguously
    num_cached: int  # physical slots already in cache (may be < position_start after eviction)
    pages: list[int]  # page table covering num_cached + len(token_ids) slots
    logits_at: list[int] = field(default_factory=list)  # indices into token_ids that need logits
    sample: SampleRequest | None = None  # sample one token from the last logits_at row


@dataclass
class StepBatch:
    seqs: list[SeqStep]
    return_logits: bool = False
    observe: dict[str, ObserveSpec] | None = None  # request id -> attention statistics to record
    # request id -> its sparse attention config (None: full); None: every row the backend's own (sparse_config)
    sparse: dict | None = None

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


@dataclass
class SeqResult:
    request_id: str
    sampled: SampledToken | None = None
    logits: torch.Tensor | None = None  # [len(logits_at), vocab] float32, when asked for


@dataclass
class StepOutput:
    results: list[SeqResult]
    observations: dict[tuple[str, int], dict[str, torch.Tensor]] = field(default_factory=dict)


@dataclass
class PendingStep:
    """A step launched on the device whose sampled ids are not read yet: the host may do other work (the
    previous step's detokenizing) before `wait()`. `overlaps`: the step really runs behind the host (its
    outputs may be emitted one step later); False for a step that already ran to the end."""
    wait: Callable[[], StepOutput]
    overlaps: bool = False

    @staticmethod
    def done(out: StepOutput) -> "PendingStep":
        return PendingStep(lambda: out)
