"""KV eviction at the end of a prefill: which prompt tokens' K/V to keep, and compacting them in place.

Who calls it: `engine.llm.LLM` when the chunk that completes a prompt has run (the first token is being
sampled) for a request whose policy applies; `bench/kv_quality.py` for the quality figures. Order:

    policy.applies(prompt_len) -> observe(policy) (ObserveSpec for that last chunk, or None) -> the step
    runs -> keep = keep_slots(policy, prompt_len, window attention per layer) -> compact(backend, pages,
    keep) -> the caller truncates the block table to len(keep) slots (pages past it go back to the pool)

Policies, registered by name in `POLICIES`:
  snapkv     score each prompt token by the attention the last `window` prompt queries pay it (averaged over
             the query heads of the layer, smoothed by a max-pool of `pool` tokens so neighbours of a hit
             survive with it), keep the top scores plus the window itself. Per layer, the same tokens for
             every KV head of that layer, so pages stay aligned across heads.
  streaming  StreamingLLM: the first `sinks` tokens (attention sinks) and the most recent ones.
Every layer keeps the same *number* of tokens (the block table has one slot count per sequence), not
necessarily the same tokens. Survivors are compacted to a dense prefix of the sequence's slots in their
original order; keys were cached after RoPE, so they keep their original positions, and the caller keeps
the logical length (next position = prompt length) apart from the physical one (slots).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention_context import ObserveSpec
from engine.errors import InvalidRequestError


@dataclass(frozen=True)
class EvictionPolicy:
    method: str = "snapkv"  # a name in POLICIES
    budget: float = 0.3  # <= 1: share of the prompt to keep; > 1: tokens to keep
    min_prompt: int = 256  # shorter prompts are kept whole
    window: int = 32  # snapkv: observation window (the last prompt queries); always kept
    pool: int = 7  # snapkv: max-pool kernel over token scores
    sinks: int = 4  # streaming: first tokens always kept

    def __post_init__(self) -> None:
        if self.method not in POLICIES:
            raise InvalidRequestError("kv_eviction.method", f"{self.method!r}; known: {', '.join(POLICIES)}")
        if not self.budget > 0:
            raise InvalidRequestError("kv_eviction.budget", "must be > 0 (a share <= 1 or a token count)")
        if self.min_prompt < 1 or self.window < 1 or self.pool < 1 or self.pool % 2 == 0 or self.sinks < 0:
            raise InvalidRequestError("kv_eviction", "min_prompt, window >= 1; pool odd >= 1; sinks >= 0")

    @classmethod
    def of(cls, value: "EvictionPolicy | dict | None") -> "EvictionPolicy | None":
        if value is None or isinstance(value, cls):
            return value
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise InvalidRequestError(f"kv_eviction.{unknown[0]}", f"unknown key; known: {', '.join(sorted(known))}")
        return cls(**value)

    def keep_count(self, prompt_len: int) -> int:
        """Slots a prompt of `prompt_len` tokens keeps (>= the window / sinks, <= the prompt)."""
        n = int(round(self.budget * prompt_len)) if self.budget <= 1 else int(self.budget)
        floor = self.window if self.method == "snapkv" else self.sinks + 1
        return max(min(n, prompt_len), min(floor, prompt_len))

    def applies(self, prompt_len: int) -> bool:
        return prompt_len >= self.min_prompt and self.keep_count(prompt_len) < prompt_len

    def observe(self) -> ObserveSpec | None:
        return ObserveSpec(window=self.window) if self.method == "snapkv" else None


def _snapkv(policy: EvictionPolicy, n: int, keep: int, attn: torch.Tensor | None) -> torch.Tensor:
    """attn: [w, n] head-averaged attention of the last w prompt queries -> kept token indices."""
    assert attn is not None and attn.shape[-1] == n, "snapkv needs the window's attention over the prompt"
    w = min(attn.shape[0], policy.window, keep)
    scores = attn.float().sum(0)[: n - w]  # [n - w] mass each earlier token received from the window
    if policy.pool > 1:  # (+ a sliver of the token's own score: a hit beats the neighbours it lifted)
        pooled = F.max_pool1d(scores.view(1, 1, -1), policy.pool, stride=1, padding=policy.pool // 2).view(-1)
        scores = pooled + 1e-3 * scores
    top = torch.topk(scores, keep - w).indices if keep > w else torch.empty(0, dtype=torch.long)
    return torch.cat([top.sort().values, torch.arange(n - w, n)])


def _streaming(policy: EvictionPolicy, n: int, keep: int, attn: torch.Tensor | None) -> torch.Tensor:
    sinks = min(policy.sinks, keep)
    return torch.cat([torch.arange(sinks), torch.arange(n - (keep - sinks), n)])


POLICIES = {"snapkv": _snapkv, "streaming": _streaming}


def keep_slots(policy: EvictionPolicy, prompt_len: int, layers, attn_by_layer: dict[int, torch.Tensor]
               ) -> dict[int, torch.Tensor]:
    """layer -> ascending prompt token indices to keep; the same count for every layer."""
    keep = policy.keep_count(prompt_len)
    fn = POLICIES[policy.method]
    out = {layer: fn(policy, prompt_len, keep, attn_by_layer.get(layer)) for layer in layers}
    assert all(len(ix) == keep for ix in out.values())
    return out


def compact(backend, pages: list[int], keep_by_layer: dict[int, torch.Tensor]) -> None:
    """Move each layer's kept cells to slots [0, keep) of the page list, in order (format-agnostic)."""
    ps = backend.spec.page_size
    for layer, keep in keep_by_layer.items():
        src = torch.tensor([pages[t // ps] * ps + t % ps for t in keep.tolist()], dtype=torch.long)
        dst = torch.tensor([pages[t // ps] * ps + t % ps for t in range(len(keep))], dtype=torch.long)
        for pool in (backend.k[layer], backend.v[layer]):
            flat = pool.view(-1, *pool.shape[2:])  # [slots, kv_heads, cell]
            flat.index_copy_(0, dst, flat.index_select(0, src))
