"""Sparse decode attention (Quest): each decode query reads only the pages its key bounds say matter.

Who calls it: `RawKVBackend._attend_group` (and so every storage format built on it) hands decode groups
here when `backend.sparse` is set (`LLM(sparse_attention=...)` -> `backend.enable_sparse`). Per step,
layer and group:
  1. `select(...)`: score each page of each row per KV head by its upper bound on q . k from the page
     summaries (`summaries.py`): sum over channels of max(q * min, q * max) = q+ . max + q- . min (two
     small matmuls); grouped-query heads reduce their KV head's bounds by max (any head that may need the
     page keeps it) or sum (`gqa`). Keep the `sink_pages` first pages and the pages of the last `recent`
     slots always, plus the best pages within `budget` tokens; sorted in page order.
     With `selection_layers` (TidalDecode's idea, with Quest's bounds in place of its full-attention
     scores), only those layers choose; every other layer reuses the latest choice of the step (a layer
     before the first selection layer chooses for itself).
  2. `attend_torch(...)`: gather the chosen pages per (row, KV head) and run one SDPA with a slot mask; or,
     with `select_per="row"` on bf16 CPU pages, the numba/C paged kernel reads the chosen pages in place
     through a shorter page table (`attend_kernel`). The kernel takes one page table per row for all its KV
     heads, so per-KV-head selection (the default) runs on the torch path; a per-(row, head) table would
     need a kernel change (not done).
Off (full attention, unchanged) for groups of several queries per row (prefill chunks, verify steps),
observed or windowed groups, rows below `min_context` slots, and whenever every row's pages fit the
selection anyway -- so a budget >= the context gives full attention exactly. Selection never changes
what is stored: turning it off gives full attention back.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine.cpu_kernels import _bf16_to_f32, _jit, bits
from engine.errors import InvalidRequestError

_FIELD = "sparse_attention"


@dataclass(frozen=True)
class SparseAttentionConfig:
    method: str = "quest"  # the only one so far
    budget: int = 1024  # tokens of top-scored pages read besides the sinks and the recent window
    sink_pages: int = 1  # first pages always read (attention sinks)
    recent: int = 64  # the last `recent` slots always read (their pages)
    min_context: int = 0  # rows with fewer slots read everything
    select_per: str = "kv_head"  # "kv_head" (Quest) or "row" (one choice for all KV heads: the paged kernel)
    gqa: str = "max"  # how query heads of one KV head combine their page bounds: "max" or "sum"
    selection_layers: tuple[int, ...] = ()  # () = every layer chooses; else only these, the others reuse

    def __post_init__(self) -> None:
        if self.method != "quest":
            raise InvalidRequestError(f"{_FIELD}.method", f"{self.method!r} is not a method; known: 'quest'")
        for key in ("budget", "sink_pages", "recent", "min_context"):
            val = getattr(self, key)
            if not isinstance(val, int) or isinstance(val, bool) or val < 0:
                raise InvalidRequestError(f"{_FIELD}.{key}", f"must be an integer >= 0, got {val!r}")
        if self.budget < 1:
            raise InvalidRequestError(f"{_FIELD}.budget", "must be >= 1 token")
        if self.select_per not in ("kv_head", "row"):
            raise InvalidRequestError(f"{_FIELD}.select_per", f"{self.select_per!r}; use 'kv_head' or 'row'")
        layers = self.selection_layers
        if isinstance(layers, list):
            object.__setattr__(self, "selection_layers", layers := tuple(layers))
        if not isinstance(layers, tuple) or any(not isinstance(x, int) or isinstance(x, bool) or x < 0 for x in layers):
            raise InvalidRequestError(f"{_FIELD}.selection_layers", f"must be a list of layer ids >= 0, got {layers!r}")
        if self.gqa not in ("max", "sum"):
            raise InvalidRequestError(f"{_FIELD}.gqa", f"{self.gqa!r}; use 'max' or 'sum'")

    @staticmethod
    def of(value) -> "SparseAttentionConfig | None":
        """None / "off" -> None; a config passes; a dict is checked key by key (unknown keys named)."""
        if value is None or value == "off":
            return None
        if isinstance(value, SparseAttentionConfig):
            return value
        if not isinstance(value, dict):
            raise InvalidRequestError(_FIELD, f"must be 'off' or a dict of fields, got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(SparseAttentionConfig)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise InvalidRequestError(f"{_FIELD}.{unknown[0]}", f"unknown key; known: {', '.join(sorted(known))}")
        return SparseAttentionConfig(**value)


def install(backend, allocator, tables, cfg: SparseAttentionConfig) -> None:
    """Turn sparse attention on for an engine's page pool (before any KV is written): the backend keeps
    page summaries, the allocator resets a freed page's, the block tables recompute a rolled-back one's."""
    summaries = backend.enable_summaries()
    backend.enable_sparse(cfg)
    allocator.add_free_hook(summaries.reset)
    tables.on_truncate.append(summaries.truncate)


@dataclass
class Selection:
    pages: torch.Tensor  # [B, kv_heads, S] page ids chosen, in page order (padding: page 0 with 0 slots)
    slots: torch.Tensor  # [B, kv_heads, S] filled slots of each chosen page read (0 = padding)


def select(cfg: SparseAttentionConfig, lo: torch.Tensor, hi: torch.Tensor, q: torch.Tensor,
           page_index: torch.Tensor, ctx_lens: list[int], page_size: int, plan: dict | None = None) -> Selection | None:
    """lo/hi [num_pages, kv_heads, D] (one layer's summaries); q [B, q_heads, D]; page_index [B, P].
    None when every row reads all its pages anyway. `plan`: a dict kept for the step (`AttnGroup.sparse_plan`)
    where what does not depend on the layer is made once."""
    plan = {} if plan is None else plan
    if "s" not in plan:
        plan.update(_plan(cfg, page_index, ctx_lens, page_size))
    if plan["s"] is None:
        return None
    b, p = page_index.shape
    h, s = lo.shape[1], plan["s"]
    scores = _bounds(cfg, lo, hi, q, page_index)  # [B, P, kv_heads]
    scores = scores.masked_fill(plan["forced"], float("inf")).masked_fill(plan["invalid"], float("-inf"))
    if cfg.select_per == "row":
        scores = scores.sum(-1, keepdim=True)  # one choice per row (inf/-inf survive the sum)
    idx = scores.topk(s, dim=1).indices.sort(dim=1).values  # [B, S, kv_heads or 1]
    idx = idx.expand(b, s, h).transpose(1, 2)  # [B, kv_heads, S]
    pages = page_index.unsqueeze(1).expand(b, h, p).gather(2, idx)
    last, tail = plan["last"], plan["tail"]  # [B, 1, 1] each
    slots = torch.where(idx == last, tail, torch.full_like(idx, page_size)).masked_fill(idx > last, 0)
    return Selection(pages.masked_fill(idx > last, 0), slots)


def _plan(cfg: SparseAttentionConfig, page_index: torch.Tensor, ctx_lens: list[int], ps: int) -> dict:
    """The layer-independent part of a group's choice: how many pages each row reads (s; None: all), which
    pages are forced (sinks, recent window, rows below min_context) and which are padding."""
    b, p = page_index.shape
    n_pages = [-(-n // ps) for n in ctx_lens]
    s = min(p, cfg.sink_pages + cfg.budget // ps + -(-cfg.recent // ps) + 1)  # +1: a window straddles pages
    s = max(s, max((n for n, c in zip(n_pages, ctx_lens) if c < cfg.min_context), default=0))
    if s >= max(n_pages):
        return {"s": None}
    j = torch.arange(p).view(1, p)
    npg = torch.tensor(n_pages).view(b, 1)
    first_recent = torch.tensor([max(0, c - cfg.recent) // ps for c in ctx_lens]).view(b, 1)
    below = torch.tensor([c < cfg.min_context for c in ctx_lens]).view(b, 1)
    forced = (j < cfg.sink_pages) | (j >= first_recent) | below  # [B, P]
    return {"s": s, "forced": forced.unsqueeze(-1), "invalid": (j >= npg).unsqueeze(-1),
            "last": (npg - 1).view(b, 1, 1), "tail": (torch.tensor(ctx_lens).view(b, 1) - (npg - 1) * ps).view(b, 1, 1)}


def _bounds(cfg, lo, hi, q, page_index) -> torch.Tensor:
    """Upper bound of q . k over each page, per row, page and KV head: [B, P, kv_heads] float32."""
    if lo.dtype == torch.bfloat16 and lo.device.type == "cpu":  # numba: summaries read in place, no gather
        kernel = _bounds_kernel(q.shape[-1], q.shape[1] // lo.shape[1], cfg.gqa == "max")
        out = np.empty((*page_index.shape, lo.shape[1]), np.float32)
        kernel(bits(q.contiguous()), bits(lo), bits(hi), page_index.numpy(), out)
        return torch.from_numpy(out)
    b, hq, d = q.shape
    h = lo.shape[1]
    qf = q.float().view(b, h, hq // h, d)  # [B, kv_heads, group, D]
    lo_p, hi_p = lo[page_index].float(), hi[page_index].float()  # [B, P, kv_heads, D]
    per_head = (torch.einsum("bphd,bhgd->bphg", hi_p, qf.clamp(min=0))
                + torch.einsum("bphd,bhgd->bphg", lo_p, qf.clamp(max=0)))  # [B, P, kv_heads, group]
    # An empty page (inf/-inf bounds, never a row's page) may give nan: those pages are masked after.
    return per_head.amax(-1) if cfg.gqa == "max" else per_head.sum(-1)


@functools.lru_cache(maxsize=None)
def _bounds_kernel(dim: int, group: int, use_max: bool):
    """Quest bounds over bf16 summaries (bits), one (row, KV head) at a time: the group's queries split in
    positive and negative parts once, then per page two dot products per query head. Padding pages of the
    page table are scored too (masked by the caller)."""

    @_jit(fastmath=True)
    def kernel(q, lo, hi, page_index, out):  # q [B, q_heads, D]; lo/hi [pages, kv_heads, D]; out [B, P, kv_heads]
        qp = np.empty((group, dim), np.float32)
        qn = np.empty((group, dim), np.float32)
        lrow = np.empty(dim, np.float32)
        hrow = np.empty(dim, np.float32)
        for b in range(q.shape[0]):
            for h in range(lo.shape[1]):
                for g in range(group):
                    for d in range(dim):
                        x = _bf16_to_f32(q[b, h * group + g, d])
                        qp[g, d] = max(x, np.float32(0.0))
                        qn[g, d] = min(x, np.float32(0.0))
                for j in range(page_index.shape[1]):
                    p = page_index[b, j]
                    for d in range(dim):
                        lrow[d] = _bf16_to_f32(lo[p, h, d])
                        hrow[d] = _bf16_to_f32(hi[p, h, d])
                    best = np.float32(-np.inf) if use_max else np.float32(0.0)
                    for g in range(group):
                        a = np.float32(0.0)
                        for d in range(dim):
                            a += qp[g, d] * hrow[d] + qn[g, d] * lrow[d]
                        best = max(best, a) if use_max else best + a
                    out[b, j, h] = best

    return kernel


def attend_torch(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, sel: Selection, scale: float) -> torch.Tensor:
    """k, v [B, kv_heads, S, page_size, D] (the chosen pages); q [B, q_heads, D] -> [B, q_heads, D]."""
    b, h, s, ps, d = k.shape
    hq = q.shape[1]
    valid = torch.arange(ps).view(1, 1, 1, ps) < sel.slots.unsqueeze(-1)  # [B, kv_heads, S, page_size]
    mask = valid.view(b, h, 1, s * ps).repeat_interleave(hq // h, dim=1)  # [B, q_heads, 1, S * page_size]
    o = F.scaled_dot_product_attention(q.view(b, hq, 1, d), k.reshape(b, h, s * ps, d), v.reshape(b, h, s * ps, d),
                                       attn_mask=mask, scale=scale, enable_gqa=hq != h)
    return o.view(b, hq, d)


def kernel_rows(sel: Selection) -> tuple[np.ndarray, np.ndarray]:
    """A row-shared selection as the paged kernel's inputs: page table [B, S] and slot counts [B]. The
    chosen pages are in page order and only a row's last page is partly filled, so slots [0, n) of the
    shorter table are exactly the chosen slots."""
    pages = sel.pages[:, 0].contiguous().numpy()
    return pages, sel.slots[:, 0].sum(-1).numpy().astype(np.int64)
