"""`AttentionContext`: what every layer's attention needs for one step, built once per step.

Built by the runner from the step batch (page tables, slot counts, query lengths) and read by the KV
backend in every layer. Packed tokens are split into groups: maximal runs of consecutive sequences with
the same number of new tokens, so a decode batch is one padded SDPA call and a prefill chunk is another.
A decode run whose context lengths are far apart is split further into length buckets (`_decode_buckets`;
such a group names its packed rows in `token_rows`), so short rows do not gather and attend the longest
row's padding -- unless the backend's decode attention has no padding (`bucket_decode=False`).
Masks come from slot counts only: query i of a sequence with `cached` slots already in cache may see
slots [0, cached + i] (with a sliding window, none below cached + i - window + 1; a model mixing local and
global layers gets a windowed view for its local layers in `AttentionContext.local`). Optional observation
(off by default) exposes attention of a query window (SnapKV-style eviction) and per-slot attention mass
(H2O-style eviction), computed by `attention_stats` a few query rows at a time.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
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
    token_rows: torch.Tensor | None = None  # [batch * q_len] packed rows when not token_start..token_end
    windowed: bool = False  # a sliding window limits what queries see (the mask says which slots)
    _bias: dict = field(default_factory=dict, repr=False)  # dtype -> additive mask (see mask_bias)
    _host: tuple | None = field(default=None, repr=False)  # see host_rows
    sparse_plan: dict = field(default_factory=dict, repr=False)  # sparse attention's per-step masks (kv_cache/sparse)
    sparse_rows: list | None = None  # per row: its own sparse config or None (full); None: the backend's for all
    lens: torch.Tensor | None = None  # [batch] int32 ctx_lens on the device (CUDA kernels; see device_lens)
    splits: int = 0  # KV splits per row of the CUDA paged kernel; 0: chosen at first use (a graph fixes it)
    static: bool = False  # a static-shape step (graph_decode): page tables of fixed width, lengths on the device

    def host_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The page table [batch, pages] and slot counts [batch] as int64 numpy arrays (CPU kernels),
        made once per step and shared by every layer."""
        if self._host is None:
            self._host = (self.page_index.numpy(), np.asarray(self.ctx_lens, dtype=np.int64))
        return self._host

    def device_lens(self) -> torch.Tensor:
        """`ctx_lens` as an int32 tensor beside the page table, made once per step (a captured CUDA graph
        hands in its static buffer instead)."""
        if self.lens is None:
            self.lens = torch.tensor(self.ctx_lens, dtype=torch.int32, device=self.page_index.device)
        return self.lens

    def mask_bias(self, dtype: torch.dtype) -> torch.Tensor | None:
        """`mask` as an additive float mask (0 where allowed, -inf elsewhere) in `dtype`, made once per
        step and shared by every layer: given the bool mask, SDPA converts it again in each layer."""
        if self.mask is None:
            return None
        if dtype not in self._bias:
            zero = torch.zeros((), dtype=dtype, device=self.mask.device)
            self._bias[dtype] = zero.masked_fill(~self.mask, float("-inf"))  # [B, 1, q_len, max_ctx]
        return self._bias[dtype]


@dataclass
class AttentionContext:
    write_slots: torch.Tensor  # [num_tokens] flat slot of each new token
    groups: list[AttnGroup]
    scale: float
    observations: dict[tuple[str, int], dict[str, torch.Tensor]] = field(default_factory=dict)
    # Models mixing local (sliding-window) and global layers (Gemma 3): the same step as the local layers
    # see it (same slots and groups, masks limited to the window), or None when no row of the step reaches
    # past the window (then every layer reads this context). `base` is set on that view: its step's context.
    local: "AttentionContext | None" = None
    base: "AttentionContext | None" = None

    def observe_attention(self, layer: int, g: AttnGroup, qh: torch.Tensor, kh: torch.Tensor) -> None:
        """Record attention statistics for observed rows. qh [B,Hq,q,D], kh [B,Hkv,ctx,D]."""
        for row, spec in g.observe.items():
            n = g.ctx_lens[row]
            mask = None if g.mask is None else g.mask[row, 0, :, :n]  # [q, n]
            stats = attention_stats(qh[row], kh[row, :, :n], self.scale, mask, g.is_causal, spec)
            self.observations.setdefault((g.request_ids[row], layer), {}).update(stats)


OBSERVE_CHUNK_ELEMS = 1 << 19  # float32 scores per query chunk (2 MiB): cache-sized, ~20 chunks at 1,024 tokens


def attention_stats(q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor | None, causal: bool,
                    spec: ObserveSpec) -> dict[str, torch.Tensor]:
    """One row's statistics in float32. q [Hq, ql, D], k [Hkv, n, D], mask [ql, n] (True = may attend) or
    None (causal: query i sees slots [0, n - ql + i]; else every slot). "window": the head mean of the
    last `spec.window` queries' probabilities [min(window, ql), n]; "slot_mass": probabilities summed over
    heads and queries [n]. Why not one [Hq, ql, n] softmax: at 1,024 tokens that is 36 MiB per layer and
    most of an H2O prefill's time. Instead query chunks of a few rows, each KV head's query heads batched
    as its rows (no repeated K), only the slots a chunk may see (a causal chunk skips the columns past its
    last query), and only the rows a statistic needs (window alone: its last rows)."""
    hq, ql, d = q.shape
    hkv, n = k.shape[0], k.shape[1]
    rep = hq // hkv
    qg = q.float().view(hkv, rep, ql, d)  # a KV head's query heads are consecutive (repeat_interleave order)
    kt = k.float().contiguous().transpose(1, 2)  # [Hkv, D, n]
    w = min(spec.window, ql) if spec.window else 0
    out = {}
    if spec.slot_mass:
        out["slot_mass"] = torch.zeros(n, dtype=torch.float32, device=q.device)
    if w:
        out["window"] = torch.zeros(w, n, dtype=torch.float32, device=q.device)
    step = max(1, OBSERVE_CHUNK_ELEMS // (hq * n))
    # Chunks start at the window's first row, so a chunk is all window rows or none.
    starts = list(range(ql - w, ql, step))
    if spec.slot_mass:
        starts = list(range(0, ql - w, step)) + starts
    tri = torch.ones(step, step, dtype=torch.bool, device=q.device).triu(1)  # [i, j]: j > i
    for r0, r1 in zip(starts, starts[1:] + [ql]):
        c = r1 - r0
        if mask is not None:
            m = mask[r0:r1]  # [c, n]
            seen = m.any(0).nonzero()
            cols = int(seen[-1]) + 1 if len(seen) else n  # nothing visible: keep the softmax's NaN
            m = m[:, :cols]
        elif causal:
            cols = n - ql + r1  # the chunk's last query sees slots [0, cols)
        else:
            cols = n
        qc = qg[:, :, r0:r1].reshape(hkv, rep * c, d)
        scores = torch.bmm(qc, kt[:, :, :cols]).mul_(scale).view(hkv, rep, c, cols)
        if mask is not None:
            scores.masked_fill_(~m, float("-inf"))
        elif causal and c > 1:  # query r0 + i sees slots < cols - c + i + 1: hide the last c columns' triangle
            scores[..., cols - c:].masked_fill_(tri[:c, :c], float("-inf"))
        probs = scores.softmax(-1)  # [Hkv, rep, c, cols]
        if spec.slot_mass:
            out["slot_mass"][:cols] += probs.sum((0, 1, 2))
        if w and r0 >= ql - w:
            out["window"][r0 - (ql - w):r1 - (ql - w), :cols] = probs.view(hq, c, cols).mean(0)
    return out


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
    bucket_decode: bool = True, sparse: dict | None = None, local_window: int | None = None,
) -> AttentionContext:
    """bucket_decode=False: decode runs stay one group whatever their lengths (a backend whose decode
    attention reads each row's own slots, with no padding to save: `RawKVBackend.ragged_decode`).
    sparse: request id -> its sparse attention config (None: full), when rows differ from the backend's.
    local_window: the window of a model's local layers where the others are global (`ModelConfig.local_window`):
    the context gets its windowed view in `local` when some row sees more slots than the window."""
    ctx = _build(seqs, page_size, scale, device, sliding_window, observe, bucket_decode, sparse)
    if local_window is not None and any(s.num_cached + s.q_len > local_window for s in seqs):
        local = _build(seqs, page_size, scale, device, local_window, observe, bucket_decode, sparse)
        local.write_slots, local.observations, local.base = ctx.write_slots, ctx.observations, ctx
        ctx.local = local
    return ctx


def _build(seqs, page_size, scale, device, sliding_window, observe, bucket_decode, sparse) -> AttentionContext:
    write: list[int] = []
    for s in seqs:
        write.extend(_slots(s.pages, page_size, s.num_cached, s.q_len))
    groups, start, i = [], 0, 0
    while i < len(seqs):
        j = i
        while j < len(seqs) and seqs[j].q_len == seqs[i].q_len:
            j += 1
        run = seqs[i:j]
        buckets = None
        if run[0].q_len == 1 and bucket_decode:
            buckets = _decode_buckets([s.num_cached + 1 for s in run])
        if buckets is None:
            groups.append(_group(run, start, page_size, device, sliding_window, observe))
        else:  # decode rows of very different lengths: one group per length bucket, rows picked by index
            for rows in buckets:
                g = _group([run[r] for r in rows], start, page_size, device, sliding_window, observe)
                g.token_rows = torch.tensor([start + r for r in rows], dtype=torch.long, device=device)
                groups.append(g)
        start += sum(s.q_len for s in run)
        i = j
    if sparse is not None:
        for g in groups:
            g.sparse_rows = [sparse.get(r) for r in g.request_ids]
    return AttentionContext(torch.tensor(write, dtype=torch.long, device=device), groups, scale)


GROUP_COST_SLOTS = 256  # one more attention group per layer costs about as much as this many padded slots
_MAX_CUTS = 16  # candidate bucket edges (quantiles of the sorted lengths): keeps the search O(16^2)


def _decode_buckets(ctx_lens: list[int]) -> list[list[int]] | None:
    """Rows of a decode run (one query each) split into buckets of similar context length, or None for
    one group in packed order. Why: a group gathers and attends `batch x longest context` slots, so 16
    rows of 64..576 slots (bench `batch` figure) spend ~45% of that on padding. Buckets minimise padded
    slots + GROUP_COST_SLOTS per group (an exact search over at most _MAX_CUTS candidate edges)."""
    n = len(ctx_lens)
    if n < 2 or max(ctx_lens) - min(ctx_lens) < GROUP_COST_SLOTS // 2:
        return None
    order = sorted(range(n), key=ctx_lens.__getitem__)
    lens = [ctx_lens[r] for r in order]
    edges = sorted({round(k * n / _MAX_CUTS) for k in range(1, _MAX_CUTS)} | {n})  # bucket ends
    edges = [e for e in edges if e > 0]
    best = {0: (0, -1)}  # end -> (cost of rows [0, end), previous end)
    for e in edges:
        best[e] = min((best[b][0] + (e - b) * lens[e - 1] + GROUP_COST_SLOTS, b) for b in best if b < e)
    cuts, e = [], n
    while e:
        cuts.append(e)
        e = best[e][1]
    if len(cuts) == 1:
        return None
    ends = cuts[::-1]
    return [order[b:e] for b, e in zip([0] + ends[:-1], ends)]


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
    uniform_decode = ql == 1 and len(set(ctx_lens)) == 1 and window is None  # every row sees max_ctx slots
    mask = None
    if not (is_causal or uniform_decode):
        cached = torch.tensor([s.num_cached for s in seqs], device=device).view(b, 1, 1, 1)
        qi = torch.arange(ql, device=device).view(1, 1, ql, 1)
        kj = torch.arange(max_ctx, device=device).view(1, 1, 1, max_ctx)
        mask = kj <= cached + qi  # [B, 1, q_len, max_ctx]
        if window is not None:
            mask &= kj > cached + qi - window
    contiguous_from = None
    if b == 1 and _consecutive(seqs[0].pages, max_ctx, ps):
        contiguous_from = seqs[0].pages[0] * ps
    obs = None
    if observe:
        obs = {r: observe[s.request_id] for r, s in enumerate(seqs) if s.request_id in observe}
    return AttnGroup(token_start, token_start + b * ql, b, ql, [s.request_id for s in seqs], ctx_lens,
                     page_index, mask, is_causal, obs or None, contiguous_from, windowed=window is not None)


def _consecutive(pages: list[int], num_slots: int, ps: int) -> bool:
    used = pages[:-(-num_slots // ps)]
    return all(b == a + 1 for a, b in zip(used, used[1:]))
