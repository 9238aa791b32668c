"""Sampler: penalties, min_tokens masking, temperature, min-p, top-k, top-p, keyed randomness, logprobs.

Called by the runner with one float32 logits row per sampled sequence (and by spec_decode's verify, one
row per draft position, each with its own output index). Order, as vLLM: penalties -> while fewer than
`min_tokens` outputs exist, EOS and `stop_token_ids` get -inf -> greedy argmax, or temperature -> min-p
(tokens below min_p x the top probability dropped) -> top-k -> top-p -> draw. Logprobs are of the raw
logits. Randomness is keyed by
(request seed, output index): the noise for a token depends on nothing else, so a request samples the
same tokens in any batch, on any worker, after any preemption. Sampling uses the exponential race
(argmax of p / E with E ~ Exp(1)), which draws exactly from p.
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from engine.request import SampledToken
from engine.sampling_params import SamplingParams

_MASK64 = (1 << 63) - 1


@dataclass
class SampleRequest:
    params: SamplingParams
    seed: int
    output_index: int  # index of the token being sampled among the request's outputs
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: Collection[int] = ()  # the model's EOS ids: masked with stop_token_ids under min_tokens


def noise_key(seed: int, output_index: int) -> int:
    x = (seed * 0x9E3779B97F4A7C15 + (output_index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    x ^= x >> 31
    return (x * 0x94D049BB133111EB) & _MASK64


def apply_penalties(logits: torch.Tensor, req: SampleRequest) -> torch.Tensor:
    p = req.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.prompt_token_ids) | set(req.output_token_ids)), dtype=torch.long)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and req.output_token_ids:
        out = torch.tensor(req.output_token_ids, dtype=torch.long)
        counts = torch.bincount(out, minlength=logits.shape[0]).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def min_tokens_mask(req: SampleRequest) -> list[int]:
    """Token ids this position may not sample: EOS and stop ids while fewer than `min_tokens` outputs exist
    (EOS even with ignore_eos, as vLLM)."""
    p = req.params
    if req.output_index >= p.min_tokens:
        return []
    return sorted(set(p.stop_token_ids) | set(req.eos_token_ids))


def filter_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below min_p x the most likely token's (logits already scaled)."""
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < logits.shape[0]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p  # keep the smallest prefix reaching top_p
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


def sample_one(logits: torch.Tensor, req: SampleRequest) -> SampledToken:
    """logits: [vocab] float32 (raw model output for this position)."""
    p = req.params
    raw = logits
    needs_penalty = p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty
    x = apply_penalties(logits.clone(), req) if needs_penalty else logits
    masked = min_tokens_mask(req)
    if masked:
        x = x.clone() if x is raw else x
        x[masked] = float("-inf")
    if p.greedy:
        token = int(torch.argmax(x))
    else:
        x = x / p.temperature
        if p.min_p > 0:
            x = filter_min_p(x, p.min_p)
        x = filter_top_k_top_p(x, p.top_k, p.top_p)
        probs = x.softmax(-1)
        g = torch.Generator().manual_seed(noise_key(req.seed, req.output_index))
        race = torch.empty_like(probs).exponential_(generator=g)
        token = int(torch.argmax(probs / race))
    if p.logprobs is None:
        return SampledToken(token)
    lp = torch.log_softmax(raw, -1)
    top = []
    if p.logprobs > 0:
        vals, ids = torch.topk(lp, p.logprobs)
        top = list(zip(ids.tolist(), vals.tolist()))
    return SampledToken(token, float(lp[token]), top)


def plain_greedy(r: SampleRequest) -> bool:
    """A row whose token is the argmax of its logits alone: no penalties, logprobs or min_tokens mask."""
    p = r.params
    return (p.greedy and p.logprobs is None and p.repetition_penalty == 1.0 and not p.presence_penalty
            and not p.frequency_penalty and r.output_index >= p.min_tokens)


def sample_batch(logits: torch.Tensor, reqs: list[SampleRequest]) -> list[SampledToken]:
    """logits: [n, vocab] on any device; greedy rows without penalties, logprobs or min_tokens masking share
    one argmax, on the logits' device (CUDA: only their B token ids cross to the host); the other rows are
    sampled here on the CPU."""
    plain = [i for i, r in enumerate(reqs) if plain_greedy(r)]
    out: list[SampledToken | None] = [None] * len(reqs)
    if plain:
        rows = logits if len(plain) == len(reqs) else logits[plain]  # all plain: no [n, vocab] copy
        # max(dim).indices == argmax (first maximum on ties, NaN wins alike) at ~0.6x its time on CPU
        ids = torch.max(rows, dim=-1).indices.tolist()
        for i, t in zip(plain, ids):
            out[i] = SampledToken(t)
    rest = [i for i in range(len(reqs)) if out[i] is None]
    if rest:
        host = logits[rest].cpu() if logits.device.type != "cpu" else None  # [len(rest), vocab]
        for j, i in enumerate(rest):
            out[i] = sample_one(logits[i] if host is None else host[j], reqs[i])
    return out
