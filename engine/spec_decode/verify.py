"""Verification of draft tokens: pure functions, no engine state (called by step.py and by tests).

`verify_greedy(draft, target_ids)` is what the engine runs, greedy *and* sampled: `target_ids[j]` is the
token the keyed sampler draws from the target's row j (row j sees the prompt, the outputs and draft[:j]).
The longest prefix where draft == target is accepted, then the target token after it (the correction on
a mismatch, the bonus token when every draft matched): 1 .. k+1 tokens, exactly the tokens plain decoding
would emit, since plain decoding draws row j's token with the same (seed, output index) noise.

`rejection_sample(draft, p, q, gen)` is Leviathan et al.'s rule for a proposal distribution q (None: a
deterministic proposal, q one-hot at the draft): accept d_j with probability min(1, p_j(d_j) / q_j(d_j));
on the first rejection emit a sample of the residual norm(max(0, p_j - q_j)) and stop; if all k are
accepted emit a bonus sample of p_k. For one-hot q it has the same law as `verify_greedy` over the keyed
sampler (accept with probability p(d), else a sample of p without d); it is the reference a stochastic
draft model would use, and what the chi-square tests check (beside deliberately broken variants).
"""
from __future__ import annotations

import torch


def accepted_length(draft: list[int], target_ids: list[int]) -> int:
    """Drafts accepted: the length of the longest prefix where draft[j] == target_ids[j]."""
    assert len(target_ids) == len(draft) + 1, (len(draft), len(target_ids))
    m = 0
    while m < len(draft) and draft[m] == target_ids[m]:
        m += 1
    return m


def verify_greedy(draft: list[int], target_ids: list[int]) -> list[int]:
    """Tokens to commit: the accepted drafts followed by the target's token after them (1 .. k+1)."""
    return list(target_ids[:accepted_length(draft, target_ids) + 1])


def sample_from(probs: torch.Tensor, gen: torch.Generator) -> int:
    """One draw from probs [vocab] (need not be normalized)."""
    return int(torch.multinomial(probs, 1, generator=gen))


def rejection_sample(draft: list[int], p: torch.Tensor, q: torch.Tensor | None, gen: torch.Generator) -> list[int]:
    """Leviathan rejection sampling. p: [k+1, vocab] target probabilities (row j given draft[:j]);
    q: [k, vocab] proposal probabilities, or None for a deterministic proposal (one-hot at draft[j])."""
    k = len(draft)
    assert p.shape[0] == k + 1 and (q is None or q.shape[0] == k)
    out: list[int] = []
    for j, d in enumerate(draft):
        qd = 1.0 if q is None else float(q[j, d])
        u = float(torch.rand((), generator=gen))
        if u * qd < float(p[j, d]):  # accept with probability min(1, p/q)
            out.append(d)
            continue
        q_row = torch.zeros_like(p[j]).index_fill_(0, torch.tensor([d]), 1.0) if q is None else q[j]
        residual = (p[j] - q_row).clamp_min(0.0)
        out.append(sample_from(residual if float(residual.sum()) > 0 else p[j], gen))
        return out
    out.append(sample_from(p[k], gen))  # every draft accepted: the bonus token
    return out
