"""`SpeculativeConfig`: how an engine speculates (frozen; built from a dict at the YAML/Ray edge).

Read by `SpecDecoder` (step.py) when `LLM(speculative=...)` is given. Per-request overrides come in
`SamplingParams.speculative` (`SpecRequestOptions`): off, a lower or higher draft cap, another proposer.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from engine.errors import InvalidRequestError

MAX_DRAFT_LIMIT = 16
PER_REQUEST_PROPOSERS = ("ngram", "recycling")  # cheap, option-free: a request may pick them anywhere


@dataclass(frozen=True)
class SpeculativeConfig:
    proposer: str = "ngram"  # a name in proposers.PROPOSERS
    max_draft: int = 4  # draft tokens per request per step, at most
    adaptive: bool = True  # per-request draft length from its running acceptance
    gate: bool = True  # speculate only when the cost model says the batch gains tokens/s
    min_accept: float = 0.3  # adaptive: draft position j only while predicted acceptance^j >= this
    gate_margin: float = 0.05  # gate: the drafted step must beat the plain one by this fraction (noise)
    proposer_options: dict[str, Any] = field(default_factory=dict)  # e.g. {"model": dir} for draft_model

    def __post_init__(self) -> None:
        if not isinstance(self.max_draft, int) or not 1 <= self.max_draft <= MAX_DRAFT_LIMIT:
            raise InvalidRequestError("speculative.max_draft", f"must be an integer in [1, {MAX_DRAFT_LIMIT}], "
                                                               f"got {self.max_draft!r}")
        if not 0.0 < self.min_accept < 1.0:
            raise InvalidRequestError("speculative.min_accept", f"must be in (0, 1), got {self.min_accept!r}")
        from engine.spec_decode.proposers import PROPOSERS  # torch-free registry

        if self.proposer not in PROPOSERS:
            raise InvalidRequestError("speculative.proposer", f"unknown proposer {self.proposer!r}; "
                                                              f"one of {', '.join(sorted(PROPOSERS))}")

    @classmethod
    def of(cls, value: "SpeculativeConfig | dict | None") -> "SpeculativeConfig | None":
        """Accept a config, a plain dict (YAML, Ray) or None (no speculation)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise InvalidRequestError("speculative", f"must be a SpeculativeConfig or a dict, got {type(value)}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise InvalidRequestError(f"speculative.{unknown[0]}", f"unknown key; known: {', '.join(sorted(known))}")
        return cls(**value)
