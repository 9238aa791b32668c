"""Device sampler: greedy, temperature, min-p, top-k and top-p for a batch of rows in one pass on the logits'
device (CUDA in the engine; any device in the tests), at static shapes, so a CUDA graph can capture it.

Who calls it: `sample_step` (the runner's eager steps, spec decode's verify, the graph step's mixed batches)
and the CUDA-graph decode step (engine/kernels/cuda/graph_sampling.py) for the rows `device_eligible` accepts -- no penalties, no logprobs,
no min_tokens mask -- when the engine's `sampler` is "device" ("auto" on CUDA). The other rows keep the CPU
sampler (engine/sampler.py). Per step: `pack_params` writes each row's parameters into one float64 array
[5, rows] (temperature, top_k, top_p, min_p, u) on the host; `sample_rows` reads them from a device copy.

Randomness: one uniform u per row, a pure function of (request seed, output index) computed on the host
(`keyed_uniform`; unseeded requests got a seed from the engine's generator at intake), drawn by inverse
transform: the first token whose cumulative probability (float64) passes u x the total. B numbers cross
to the device, not B x vocab: no device generator, no per-element noise, nothing a graph replay must
advance; a row's token depends on its logits, its parameters and its key alone, so a seeded request
samples the same tokens run after run and in any batch. The cumulative order is per row: descending
probability (one stable sort) for a row with min-p, top-k or top-p, token-id order for a plain-temperature
row, whichever variant (`filtered`) its step ran. Masks as the CPU sampler's, in its order: temperature ->
min-p (p < min_p x max p) -> top-k (below the k-th logit; ties kept) -> top-p (the smallest prefix
reaching top_p, renormalised). These rows draw other tokens than the CPU sampler's exponential race with
the same seed (both exact draws from the same distribution), so the choice is per engine, never per batch.
`reference_sample` (one row, the CPU sampler's masks, a plain loop) is the oracle the tests compare with.
"""
from __future__ import annotations

import numpy as np
import torch

from engine.request import SampledToken
from engine.sampler import (SampleRequest, filter_min_p, filter_top_k_top_p, noise_key, plain_greedy,
                            sample_batch)

CHOICES = ("auto", "cpu", "device")
FIELDS = 5  # rows of the packed parameters: temperature, top_k, top_p, min_p, u


def resolve(choice: str, device: str | torch.device) -> str:
    """The engine's sampler: "device" or "cpu" ("auto": device on CUDA); a typed error for another name."""
    if choice not in CHOICES:
        from engine.errors import InvalidRequestError

        raise InvalidRequestError("sampler", f"{choice!r} is not one of {', '.join(CHOICES)}")
    if choice == "auto":
        return "device" if torch.device(device).type == "cuda" else "cpu"
    return choice


def device_eligible(r: SampleRequest) -> bool:
    """A row the device sampler draws exactly as asked: no penalties, no logprobs, no min_tokens mask."""
    p = r.params
    return (p.logprobs is None and p.repetition_penalty == 1.0 and not p.presence_penalty
            and not p.frequency_penalty and r.output_index >= p.min_tokens)


def needs_filter(r: SampleRequest) -> bool:
    """A sampled row with min-p, top-k or top-p (its cumulative order is the sorted one)."""
    p = r.params
    return not p.greedy and (p.min_p > 0 or p.top_k > 0 or p.top_p < 1.0)


def keyed_uniform(seed: int, output_index: int) -> float:
    """u in [0, 1 - 2^-32]: 32 bits of the (seed, output index) key, on a 2^-32 grid (so u x total < total
    exactly in float64)."""
    return (noise_key(seed, output_index) >> 31) / 2.0 ** 32


def pack_params(reqs: list[SampleRequest], out: np.ndarray | None = None) -> np.ndarray:
    """[FIELDS, rows] float64 (rows >= len(reqs); rows past them greedy, i.e. unused)."""
    out = np.zeros((FIELDS, len(reqs)), dtype=np.float64) if out is None else out
    n = len(reqs)
    out[:, n:] = 0.0
    ps = [r.params for r in reqs]  # one assignment a field (the host's share of a step: ~1.3 us a row)
    out[0, :n] = [p.temperature for p in ps]
    out[1, :n] = [max(p.top_k, 0) for p in ps]
    out[2, :n] = [p.top_p for p in ps]
    out[3, :n] = [p.min_p for p in ps]
    out[4, :n] = [keyed_uniform(r.seed, r.output_index) for r in reqs]
    return out


def distribution(logits: torch.Tensor, params: torch.Tensor, filtered: bool
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Each row's masked distribution in its cumulative order: probs [B, vocab] float32 (unnormalised, 0 where
    masked); with `filtered` also order [B, vocab] int64 (the descending sort's token ids) and sorts [B] bool
    (the rows whose probs are in that order; the others in token-id order); else None, None. Rows at
    temperature 0 are meaningless here (`sample_rows` takes their argmax)."""
    x = logits.float()
    vocab = x.shape[-1]
    temp, top_k, top_p, min_p = params[0].float(), params[1].long(), params[2].float(), params[3].float()
    greedy = temp == 0
    x = x / torch.where(greedy, torch.ones_like(temp), temp).unsqueeze(1)  # [B, vocab]
    probs = x.softmax(-1)  # token-id order: plain-temperature rows
    if not filtered:
        return probs, None, None
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab))
    rowf = ((top_k > 0) | (top_p < 1.0) | (min_p > 0)) & ~greedy  # [B] rows that sort (as `needs_filter`)
    vals, order = torch.sort(x, dim=-1, descending=True, stable=True)  # [B, vocab]
    ps = vals.softmax(-1)
    drop = ps < (min_p * ps[:, 0]).unsqueeze(1)  # min-p (a suffix of the sorted row)
    drop |= vals < vals.gather(1, (k - 1).unsqueeze(1))  # top-k: below the k-th logit (ties kept)
    kept = vals.masked_fill(drop, float("-inf")).softmax(-1)  # renormalised over the survivors
    excl = kept.cumsum(-1) - kept  # mass before each token
    drop = (excl >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)  # top-p: keep the prefix reaching p
    kept = kept.masked_fill(drop, 0.0)
    return torch.where(rowf.unsqueeze(1), kept, probs), order, rowf


def kept_tokens(logits: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """[B, vocab] bool in token-id order: the tokens each row may draw (the tests' view of the masks)."""
    probs, order, sorts = distribution(logits, params, True)
    by_id = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, order, probs > 0)
    return torch.where(sorts.unsqueeze(1), by_id, probs > 0)


def sample_rows(logits: torch.Tensor, params: torch.Tensor, filtered: bool) -> torch.Tensor:
    """logits [B, vocab] (any float dtype, any device); params [FIELDS, B] float64 on the same device.
    Returns [B] int64 token ids, on the device. `filtered`: some row has min-p, top-k or top-p (one sort of
    every row); False only when none has (a row's token is the same in either variant). No host sync."""
    vocab = logits.shape[-1]
    probs, order, sorts = distribution(logits, params, filtered)
    cum = probs.double().cumsum(-1)  # [B, vocab]: float64 so a tail token keeps its share
    target = (params[4] * cum[:, -1]).unsqueeze(1)  # u x the row's total
    idx = torch.searchsorted(cum, target, right=True).clamp_(max=vocab - 1)  # [B, 1]: first cum > target
    token = idx.squeeze(1) if order is None else torch.where(sorts, order.gather(1, idx).squeeze(1), idx.squeeze(1))
    return torch.where(params[0] == 0, torch.max(logits, dim=-1).indices, token)


def sample_eligible(logits: torch.Tensor, reqs: list[SampleRequest]) -> torch.Tensor:
    """Eager use: logits [n, vocab] on any device, every row `device_eligible`; [n] int64 ids on that device."""
    params = torch.from_numpy(pack_params(reqs)).to(logits.device, non_blocking=True)
    return sample_rows(logits, params, any(needs_filter(r) for r in reqs))


def reference_sample(logits: torch.Tensor, req: SampleRequest) -> int:
    """One row the plain way (the oracle): the CPU sampler's masks, then the first token, in the row's
    cumulative order, whose running total passes u x the total."""
    p = req.params
    if p.greedy:
        return int(torch.argmax(logits))
    x = logits.float() / p.temperature
    if p.min_p > 0:
        x = filter_min_p(x, p.min_p)
    x = filter_top_k_top_p(x, p.top_k, p.top_p)
    probs = x.softmax(-1).double()
    order = torch.sort(x, descending=True, stable=True).indices if needs_filter(req) else torch.arange(len(x))
    target = keyed_uniform(req.seed, req.output_index) * float(probs.sum())
    total = 0.0
    for t in order.tolist():
        total += float(probs[t])
        if total > target:
            return t
    return int(order[-1])


def sample_step(logits: torch.Tensor, reqs: list[SampleRequest], sampler: str = "cpu") -> list[SampledToken]:
    """logits [n, vocab] on any device, one row per request. sampler "cpu": `engine.sampler.sample_batch`
    as ever; "device": the `device_eligible` sampled rows in one pass here (only their ids cross to the
    host), the others through `sample_batch` (plain greedy rows' argmax on the device, the rest from a host
    copy of only their rows)."""
    dev = [i for i, r in enumerate(reqs) if sampler == "device" and not plain_greedy(r) and device_eligible(r)]
    if not dev:
        return sample_batch(logits, reqs)
    out: list[SampledToken | None] = [None] * len(reqs)
    rows = logits if len(dev) == len(reqs) else logits[dev]
    for i, t in zip(dev, sample_eligible(rows, [reqs[i] for i in dev]).tolist()):
        out[i] = SampledToken(t)
    rest = [i for i in range(len(reqs)) if out[i] is None]
    if rest:
        for i, t in zip(rest, sample_batch(logits[rest], [reqs[i] for i in rest])):
            out[i] = t
    return out
