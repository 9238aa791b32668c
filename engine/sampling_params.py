"""`SamplingParams`: what a request asks of the sampler, validated at the boundary.

Validation raises `InvalidRequestError` naming the field; the scheduler and sampler then trust the values.
Fields follow vLLM's names and meaning (the HTTP frontend takes them as top-level body fields):
`min_tokens` (EOS and `stop_token_ids` are masked, stop strings not searched, until that many tokens),
`min_p` (drop tokens below min_p x the top token's probability), `include_stop_str_in_output`,
`skip_special_tokens`, `ignore_eos`, `top_k`, `repetition_penalty`, `stop_token_ids`. pdserve's own:
`speculative`, `kv_eviction` and `sparse_attention` ("off" or fields over the engine's settings).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError


@dataclass
class SpecRequestOptions:
    """Per-request speculation override (the `pdserve.speculative` HTTP option); outputs never change."""
    enabled: bool = True  # False: never draft for this request
    max_draft: int | None = None  # cap on draft tokens per step (None: the engine's)
    proposer: str | None = None  # another proposer (the engine's own, or ngram / recycling)


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0
    repetition_penalty: float = 1.0  # Hugging Face style, over prompt and output
    presence_penalty: float = 0.0  # OpenAI style, over output tokens
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per token (0 = chosen token only)
    seed: int | None = None
    skip_special_tokens: bool = True
    speculative: SpecRequestOptions | None = None  # engines without speculation ignore it
    kv_eviction: dict | str | None = None  # "off", or fields overriding the pool's EvictionPolicy
    sparse_attention: dict | str | None = None  # "off", or fields overriding the engine's (kv_cache/sparse_config)
    min_tokens: int = 0  # no EOS / stop token id / stop string ends the output before this many tokens
    min_p: float = 0.0  # 0 = off; else keep tokens with p >= min_p * max p (after temperature)
    include_stop_str_in_output: bool = False  # the text keeps the stop string that ended it

    def __post_init__(self) -> None:
        if isinstance(self.speculative, dict):
            self.speculative = SpecRequestOptions(**self.speculative)
        if isinstance(self.stop, str):  # OpenAI accepts a single string
            self.stop = [self.stop]
        if isinstance(self.stop_token_ids, int) and not isinstance(self.stop_token_ids, bool):
            self.stop_token_ids = [self.stop_token_ids]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int) -> None:
        def bad(name: str, why: str):
            raise InvalidRequestError(name, why)

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        for name in ("temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                bad(name, f"must be a finite number, got {v!r}")
        if self.temperature < 0:
            bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            bad("top_k", f"must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                bad(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if not isinstance(self.min_p, (int, float)) or isinstance(self.min_p, bool) or not 0 <= self.min_p <= 1:
            bad("min_p", f"must be a number in [0, 1], got {self.min_p!r}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            bad("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            bad("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "stop strings must be non-empty strings")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
                bad("stop_token_ids", f"token id {t!r} outside the vocabulary [0, {vocab_size})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            bad("logprobs", f"must be an integer in [0, 20], got {self.logprobs!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            bad("seed", f"must be a non-negative integer, got {self.seed!r}")
        if self.kv_eviction is not None:
            from engine.kv_cache.eviction_policy import resolve  # (pure Python)

            if self.kv_eviction != "off":
                resolve(None, self.kv_eviction)  # a typed error names a bad field
        if self.sparse_attention is not None:
            from engine.kv_cache.sparse_config import check_value  # (pure Python)

            check_value(self.sparse_attention)  # the engine checks it against its own config at intake
        o = self.speculative
        if o is not None:
            if not isinstance(o, SpecRequestOptions) or not isinstance(o.enabled, bool):
                bad("speculative", "must be {enabled: bool, max_draft: int, proposer: str}")
            if o.max_draft is not None and (not isinstance(o.max_draft, int) or isinstance(o.max_draft, bool)
                                            or not 0 <= o.max_draft <= 16):
                bad("speculative.max_draft", f"must be an integer in [0, 16], got {o.max_draft!r}")
            if o.proposer is not None and (not isinstance(o.proposer, str) or not o.proposer):
                bad("speculative.proposer", f"must be a proposer name, got {o.proposer!r}")
