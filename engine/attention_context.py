"""`AttentionContext`: what every layer's attention needs for one step, built once per step.

Built by the runner from the step batch (page tables, slot counts, query lengths) and read by the KV
backend in every layer. Packed tokens are split into groups: maximal runs of consecutive sequences with
the same number of new tokens, so a decode batch is one padded SDPA call and a prefill chunk is another.
Masks come from slot counts only: query i of a sequence with `cached` slots already in cache may see
slots [0, cached + i]. Optional observation (off by default) exposes attention of a query window
(SnapKV-style eviction) and per-slot attention mass (H2O-style eviction).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ObserveSpec:
    window: int = 0  # keep the head-averaged attention of the last `window` queries: [window, ctx]
    slot_mass: bool = False  # keep attention mass per slot summed over queries and heads: [ctx]


@dataclass
class AttnGroup:
    token_start: int
    token_end: int
    batch: int
    q_len: int
    request_ids: list[str]
    ctx_lens: list[int]  # slots each sequence attends to after this step's writes
    page_index: torch.Tensor  # [batch, pages covering max_ctx] page ids, padded with page 0
    mask: torch.Tensor | None  # [batch, 1, q_len, max_ctx] bool, True = may attend
    is_causal: bool
    observe: dict[int, ObserveSpec] | None = None  # batch row -> what to record
    contiguous_from: int | None = None  # batch of 1 whose slots are one flat range: read a view, no gather


@dataclass
class AttentionContext:
    write_slots: torch.Tensor  # [num_tokens] flat slot of each new token
    groups: list[AttnGroup]
    scale: float
    observations: dict[tuple[str, int], dict[str, torch.Tensor]] = field(default_factory=dict)

    def observe_attention(self, layer: int, g: AttnGroup, qh: torch.Tensor, kh: torch.Tensor) -> None:
        """Record attention statistics for observed rows. qh [B,Hq,q,D], kh [B,Hkv,ctx,D]."""
        rep = qh.shape[1] // kh.shape[1]
        for row, spec in g.observe.items():
            n = g.ctx_lens[row]
            k = kh[row, :, :n].repeat_interleave(rep, dim=0)  # [Hq, n, D]
            scores = (qh[row].float() @ k.float().transpose(-1, -2)) * self.scale  # [Hq, q, n]
            if g.mask is not None:
                scores = scores.masked_fill(~g.mask[row, :, :, :n], float("-inf"))
            elif g.is_causal:
                causal = torch.ones(g.q_len, n, dtype=torch.bool).tril(n - g.q_len)
                scores = scores.masked_fill(~causal, float("-inf"))
            probs = scores.softmax(-1)
            rec = self.observations.setdefault((g.request_ids[row], layer), {})
            if spec.window:
                rec["window"] = probs[:, -spec.window:].mean(0)
            if spec.slot_mass:
                rec["slot_mass"] = probs.sum((0, 1))


@dataclass(frozen=True)
class SeqLayout:
    """One sequence's part of a step, as the context builder needs it."""

    request_id: str
    q_len: int  # new tokens this step
    num_cached: int  # slots in cache before this step
    pages: list[int]  # page table (covers num_cached + q_len slots)


def build_context(
    seqs: list[SeqLayout], page_size: int, scale: float, device="cpu",
    sliding_window: int | None = None, observe: dict[str, ObserveSpec] | None = None,
) -> AttentionContext:
    write: list[int] = []
    for s in seqs:
        write.extend(_slots(s.pages, page_size, s.num_cached, s.q_len))
    groups, start, i = [], 0, 0
    while i < len(seqs):
        j = i
        while j < len(seqs) and seqs[j].q_len == seqs[i].q_len:
            j += 1
        groups.append(_group(seqs[i:j], start, page_size, device, sliding_window, observe))
        start = groups[-1].token_end
        i = j
    return AttentionContext(torch.tensor(write, dtype=torch.long, device=device), groups, scale)


def _slots(pages: list[int], ps: int, start: int, count: int) -> list[int]:
    return [pages[i // ps] * ps + i % ps for i in range(start, start + count)]


def _group(seqs, token_start, ps, device, window, observe) -> AttnGroup:
    b, ql = len(seqs), seqs[0].q_len
    ctx_lens = [s.num_cached + ql for s in seqs]
    max_ctx = max(ctx_lens)
    n_pages = -(-max_ctx // ps)
    # Whole pages are gathered (rows of page_size * kv_heads * head_dim elements: faster than per slot);
    # slots past a sequence's length are masked, padding rows point at page 0.
    rows = [s.pages[:-(-n // ps)] + [0] * (n_pages - -(-n // ps)) for s, n in zip(seqs, ctx_lens)]
    page_index = torch.tensor(rows, dtype=torch.long, device=device)
    is_causal = b == 1 and seqs[0].num_cached == 0 and ql > 1 and window is None
    uniform_decode = ql == 1 and len(set(ctx_lens)) == 1 and window is None
    mask = None
    if not is_causal:
        cached = torch.tensor([s.num_cached for s in seqs], device=device).view(b, 1, 1, 1)
        qi = torch.arange(ql, device=device).view(1, 1, ql, 1)
        kj = torch.arange(max_ctx, device=device).view(1, 1, 1, max_ctx)
        mask = kj <= cached + qi  # [B, 1, q_len, max_ctx]
        if window is not None:
            mask &= kj > cached + qi - window
        if uniform_decode:
            mask = None  # every row sees exactly max_ctx slots
    contiguous_from = None
    if b == 1 and _consecutive(seqs[0].pages, max_ctx, ps):
        contiguous_from = seqs[0].pages[0] * ps
    obs = None
    if observe:
        obs = {r: observe[s.request_id] for r, s in enumerate(seqs) if s.request_id in observe}
    return AttnGroup(token_start, token_start + b * ql, b, ql, [s.request_id for s in seqs], ctx_lens,
                     page_index, mask, is_causal, obs or None, contiguous_from)


def _consecutive(pages: list[int], num_slots: int, ps: int) -> bool:
    used = pages[:-(-num_slots // ps)]
    return all(b == a + 1 for a, b in zip(used, used[1:]))
