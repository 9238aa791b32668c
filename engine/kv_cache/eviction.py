"""KV eviction at the end of a prefill: which prompt tokens' K/V to keep, and compacting them in place.

Who calls it: `engine.llm.LLM` when the chunk that completes a prompt has run (the first token is being
sampled) for a request whose policy applies; `bench/kv/kv_quality.py` for the quality figures. Order:

    policy.applies(prompt_len) -> observe(policy) (ObserveSpec for that last chunk, or None) -> the step
    runs -> keep = keep_slots(policy, prompt_len, window attention per layer) -> compact(backend, pages,
    keep) -> the caller truncates the block table to len(keep) slots (pages past it go back to the pool)

Policies, registered by name in `POLICIES`:
  snapkv     score each prompt token by the attention the last `window` prompt queries pay it (averaged over
             the query heads of the layer, smoothed by a max-pool of `pool` tokens so neighbours of a hit
             survive with it), keep the top scores plus the window itself. Per layer, the same tokens for
             every KV head of that layer, so pages stay aligned across heads.
  streaming  StreamingLLM: the first `sinks` tokens (attention sinks) and the most recent ones.
  h2o        heavy hitters (H2O): the slots that received the most attention so far, plus the `window`
             most recent; applied at the end of the prompt and again during decode (`engine/evictor.py`
             keeps the scores), so a sequence's memory stays bounded.
Every layer keeps the same *number* of tokens (the block table has one slot count per sequence), not
necessarily the same tokens. Survivors are compacted to a dense prefix of the sequence's slots in their
original order; keys were cached after RoPE, so they keep their original positions, and the caller keeps
the logical length (next position = prompt length) apart from the physical one (slots).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kv_cache.eviction_policy import POLICY_NAMES, EvictionPolicy

__all__ = ["EvictionPolicy", "POLICIES", "keep_slots", "compact"]


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


def _h2o(policy: EvictionPolicy, n: int, keep: int, mass: torch.Tensor | None) -> torch.Tensor:
    """mass: [n] attention each slot received so far -> the heaviest hitters plus the recent window."""
    assert mass is not None and len(mass) == n, "h2o needs the accumulated attention mass of every slot"
    recent = min(policy.window, keep)
    top = torch.topk(mass[: n - recent].float(), keep - recent).indices if keep > recent else torch.empty(0)
    return torch.cat([top.long().sort().values, torch.arange(n - recent, n)])


POLICIES = {"snapkv": _snapkv, "streaming": _streaming, "h2o": _h2o}
assert set(POLICIES) == set(POLICY_NAMES)


def keep_slots(policy: EvictionPolicy, num_slots: int, layers, stats_by_layer: dict[int, torch.Tensor],
               keep: int | None = None) -> dict[int, torch.Tensor]:
    """layer -> ascending slot indices to keep (`keep`, default the policy's count for a prompt of
    `num_slots` tokens); the same count for every layer. `stats_by_layer`: what the policy scores by
    (snapkv: the window's attention [w, n]; h2o: accumulated mass per slot [n]; streaming: nothing)."""
    keep = policy.keep_count(num_slots) if keep is None else keep
    fn = POLICIES[policy.method]
    out = {layer: fn(policy, num_slots, keep, stats_by_layer.get(layer)) for layer in layers}
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
    if getattr(backend, "summaries", None) is not None and keep_by_layer:  # sparse attention's page bounds
        backend.summaries.rebuild(pages, len(next(iter(keep_by_layer.values()))))
