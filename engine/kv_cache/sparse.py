"""Sparse decode attention (Quest): each decode query reads only the pages its key bounds say matter.

Who calls it: `RawKVBackend._attend_group` (and so every storage format built on it) hands decode groups
here when `backend.sparse` is set (`LLM(sparse_attention=...)` -> `backend.enable_sparse`). Per step,
layer and group:
  1. `select(...)`: score each page of each row per KV head by its upper bound on q . k from the page
     summaries (`summaries.py`): sum over channels of max(q * min, q * max) = q+ . max + q- . min (two
     small matmuls); grouped-query heads reduce their KV head's bounds by max (any head that may need the
     page keeps it) or sum (`gqa`). Keep the `sink_pages` first pages and the pages of the last `recent`
     slots always, plus the best pages within `budget` tokens; sorted in page order. bf16 summaries on
     CPU: one numba call per layer does all of it (`quest_select.py`); this module's torch path is its
     reference (and the path of float32 / quantized pools and CUDA).
     With `selection_layers` (TidalDecode's idea, with Quest's bounds in place of its full-attention
     scores), only those layers choose; every other layer reuses the latest choice of the step (a layer
     before the first selection layer chooses for itself). The first `dense_layers` layers read everything.
  2. bf16 pages on CPU: the numba/C paged kernel reads the chosen pages in place through shorter page
     tables (`kernel_rows`): one per row with select_per="row", one per (row, KV head) otherwise (the
     default). Elsewhere (float32, int8/fp8 pages, CUDA) `attend_torch(...)` gathers the chosen pages per
     (row, KV head) and runs one SDPA with a slot mask.
Per request: a group may carry each row's own config (`AttnGroup.sparse_rows`, from `StepBatch.sparse`,
resolved in `sparse_config.py`; None for a row = full attention): budgets, sinks, windows and thresholds
apply row by row (a row of a smaller budget keeps only its best pages of the group's top-k), rows differing
in select_per / gqa are scored each its own way, and `choose` lets each row reuse or choose per its own
selection_layers; the kernel reads mixed groups through per-(row, KV head) tables.
Off (full attention, unchanged) for groups of several queries per row (prefill chunks, verify steps),
observed or windowed groups, rows below `min_context` slots, and whenever every row's pages fit the
selection anyway -- so a budget >= the context gives full attention exactly. Selection never changes
what is stored: turning it off gives full attention back.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine.kernels.cpu import quest_select
from engine.kv_cache.sparse_config import SparseAttentionConfig, check_page_size  # noqa: F401 (re-exported)


def install(backend, allocator, tables, cfg: SparseAttentionConfig) -> None:
    """Turn sparse attention on for an engine's page pool (before any KV is written): the backend keeps
    page summaries, the allocator resets a freed page's, the block tables recompute a rolled-back one's."""
    check_page_size(cfg, backend.spec.page_size)
    summaries = backend.enable_summaries()
    backend.enable_sparse(cfg)
    allocator.add_free_hook(summaries.reset)
    tables.on_truncate.append(summaries.truncate)


@dataclass
class Selection:
    pages: torch.Tensor  # [B, kv_heads, S] page ids chosen, in page order (padding: page 0 with 0 slots)
    slots: torch.Tensor  # [B, kv_heads, S] filled slots of each chosen page read (0 = padding)
    lens: np.ndarray | None = None  # [B, kv_heads] slots.sum(-1) where the kernel made it (int64)


Rows = list  # per row of a group: its SparseAttentionConfig, or None (full attention); None: all the engine's


def choose(cfg: SparseAttentionConfig, rows: Rows | None, lo: torch.Tensor, hi: torch.Tensor, q: torch.Tensor,
           page_index: torch.Tensor, ctx_lens: list[int], page_size: int, plan: dict, layer: int) -> Selection | None:
    """One layer's pages for a decode group: `select` where a row's config chooses at this layer, the
    step's latest choice (`plan["chosen"]`) where it reuses it (selection_layers)."""
    cfgs = rows if rows is not None else [cfg]
    if layer < cfg.dense_layers:  # (every row's: a request cannot change it)
        return None
    if "chosen" in plan:
        prev = plan["chosen"]
        reuse = [c is not None and not c.chooses_at(layer) for c in cfgs]
        if prev is None or all(r for r, c in zip(reuse, cfgs) if c is not None):
            return prev  # (None: every row reads all its pages this step)
    sel = select(cfg, lo, hi, q, page_index, ctx_lens, page_size, plan, rows)
    if "chosen" in plan and sel is not None and any(reuse):  # rows of different selection layers
        keep = torch.tensor(reuse).view(-1, 1, 1)
        sel = Selection(torch.where(keep, prev.pages, sel.pages), torch.where(keep, prev.slots, sel.slots))
    plan["chosen"] = sel
    return sel


def select(cfg: SparseAttentionConfig, lo: torch.Tensor, hi: torch.Tensor, q: torch.Tensor,
           page_index: torch.Tensor, ctx_lens: list[int], page_size: int, plan: dict | None = None,
           rows: Rows | None = None, kernel: bool = True) -> Selection | None:
    """lo/hi [num_pages, kv_heads, D] (one layer's summaries); q [B, q_heads, D]; page_index [B, P].
    None when every row reads all its pages anyway. `plan`: a dict kept for the step (`AttnGroup.sparse_plan`)
    where what does not depend on the layer is made once. `rows`: each row's own config (None: full).
    bf16 summaries on CPU: the numba kernel of `quest_select.py` (kernel=False: the torch path, its
    reference)."""
    plan = {} if plan is None else plan
    if "s" not in plan:
        plan.update(_plan(rows if rows is not None else [cfg] * len(ctx_lens), page_index, ctx_lens, page_size))
    if plan["s"] is None:
        return None
    if kernel and lo.dtype == torch.bfloat16 and lo.device.type == "cpu" and q.dtype == torch.bfloat16:
        return Selection(*quest_select.select_pages(plan["rows_np"], plan["s"], lo, hi, q, page_index, page_size))
    b, p = page_index.shape
    h, s = lo.shape[1], plan["s"]
    if plan["gqa_sum"] is None:
        scores = _bounds(plan["gqa"], lo, hi, q, page_index)  # [B, P, kv_heads]
    else:  # rows of both kinds: score both ways, each row takes its own
        scores = torch.where(plan["gqa_sum"], _bounds(_SUM, lo, hi, q, page_index), _bounds(_MAX, lo, hi, q, page_index))
    scores = scores.masked_fill(plan["forced"], float("inf")).masked_fill(plan["invalid"], float("-inf"))
    if plan["row_mode"] is not None:  # one choice per row for all its KV heads (inf/-inf survive the sum)
        summed = scores.sum(-1, keepdim=True)
        scores = summed if plan["all_row"] else torch.where(plan["row_mode"], summed.expand_as(scores), scores)
    top = scores.topk(s, dim=1).indices  # [B, S, kv_heads or 1], best first
    if plan["keep"] is not None:  # rows of smaller budgets drop their worst: index p sorts after every page
        top = top.masked_fill(torch.arange(s, device=top.device).view(1, s, 1) >= plan["keep"], p)
    idx = top.sort(dim=1).values.expand(b, s, h).transpose(1, 2)  # [B, kv_heads, S]
    pages = page_index.unsqueeze(1).expand(b, h, p).gather(2, idx.clamp(max=p - 1))
    last, tail = plan["last"], plan["tail"]  # [B, 1, 1] each
    slots = torch.where(idx == last, tail, torch.full_like(idx, page_size)).masked_fill(idx > last, 0)
    return Selection(pages.masked_fill(idx > last, 0), slots)


_MAX, _SUM = SparseAttentionConfig(gqa="max"), SparseAttentionConfig(gqa="sum")


def _plan(cfgs: Rows, page_index: torch.Tensor, ctx_lens: list[int], ps: int) -> dict:
    """The layer-independent part of a group's choice: how many pages each row reads (s: the most; None:
    every row reads all), which pages are forced (sinks, recent window, rows below min_context or with no
    config) and which are padding; per-row kinds where rows differ (select_per, gqa)."""
    b, p = page_index.shape
    dev = page_index.device  # masks beside the scores they apply to (CUDA: no host tensors in the choice)
    n_pages = [-(-n // ps) for n in ctx_lens]
    full = [c is None or n < c.min_context for c, n in zip(cfgs, ctx_lens)]
    # +1: a recent window straddles pages
    s_row = [n if f else min(n, c.sink_pages + c.budget // ps + -(-c.recent // ps) + 1)
             for c, n, f in zip(cfgs, n_pages, full)]
    if all(sr >= n for sr, n in zip(s_row, n_pages)):
        return {"s": None}
    s = max(s_row)
    live = [c for c in cfgs if c is not None]
    j = torch.arange(p, device=dev).view(1, p)
    npg = torch.tensor(n_pages, device=dev).view(b, 1)
    sinks = torch.tensor([c.sink_pages if c is not None else 0 for c in cfgs], device=dev).view(b, 1)
    first_recent = torch.tensor([max(0, n - c.recent) // ps if c is not None else 0
                                 for c, n in zip(cfgs, ctx_lens)], device=dev).view(b, 1)
    forced = (j < sinks) | (j >= first_recent) | torch.tensor(full, device=dev).view(b, 1)  # [B, P]
    per_row = [c.select_per == "row" for c in live]
    sums = [c.gqa == "sum" for c in live]
    plan = {"s": s, "forced": forced.unsqueeze(-1), "invalid": (j >= npg).unsqueeze(-1),
            "last": (npg - 1).view(b, 1, 1), "tail": (torch.tensor(ctx_lens, device=dev).view(b, 1) - (npg - 1) * ps).view(b, 1, 1),
            "keep": None, "row_mode": None, "all_row": all(per_row),
            "gqa": _SUM if all(sums) else _MAX, "gqa_sum": None}
    plan["rows_np"] = quest_select.row_numbers(  # the same per row for the CPU kernel
        n_pages, s_row, sinks.view(-1).tolist(), first_recent.view(-1).tolist(), plan["tail"].view(-1).tolist(),
        [c is not None and c.select_per == "row" for c in cfgs], [c is not None and c.gqa == "sum" for c in cfgs])
    if any(sr < min(s, n) for sr, n in zip(s_row, n_pages)):
        plan["keep"] = torch.tensor(s_row, device=dev).view(b, 1, 1)
    if any(per_row):
        row_mode = [c is not None and c.select_per == "row" for c in cfgs]
        plan["row_mode"] = torch.tensor(row_mode, device=dev).view(b, 1, 1)
    if any(sums) and not all(sums):
        gqa_sum = [c is not None and c.gqa == "sum" for c in cfgs]
        plan["gqa_sum"] = torch.tensor(gqa_sum, device=dev).view(b, 1, 1)
    return plan


def _bounds(cfg, lo, hi, q, page_index) -> torch.Tensor:
    """Upper bound of q . k over each page, per row, page and KV head: [B, P, kv_heads] float32."""
    b, hq, d = q.shape
    h = lo.shape[1]
    qf = q.float().view(b, h, hq // h, d)  # [B, kv_heads, group, D]
    lo_p, hi_p = lo[page_index].float(), hi[page_index].float()  # [B, P, kv_heads, D]
    per_head = (torch.einsum("bphd,bhgd->bphg", hi_p, qf.clamp(min=0))
                + torch.einsum("bphd,bhgd->bphg", lo_p, qf.clamp(max=0)))  # [B, P, kv_heads, group]
    # An empty page (inf/-inf bounds, never a row's page) may give nan: those pages are masked after.
    return per_head.amax(-1) if cfg.gqa == "max" else per_head.sum(-1)


def attend_torch(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, sel: Selection, scale: float) -> torch.Tensor:
    """k, v [B, kv_heads, S, page_size, D] (the chosen pages); q [B, q_heads, D] -> [B, q_heads, D]."""
    b, h, s, ps, d = k.shape
    hq = q.shape[1]
    valid = torch.arange(ps).view(1, 1, 1, ps) < sel.slots.unsqueeze(-1)  # [B, kv_heads, S, page_size]
    mask = valid.view(b, h, 1, s * ps).repeat_interleave(hq // h, dim=1)  # [B, q_heads, 1, S * page_size]
    o = F.scaled_dot_product_attention(q.view(b, hq, 1, d), k.reshape(b, h, s * ps, d), v.reshape(b, h, s * ps, d),
                                       attn_mask=mask, scale=scale, enable_gqa=hq != h)
    return o.view(b, hq, d)


def kernel_rows(sel: Selection, shared: bool) -> tuple[np.ndarray, np.ndarray]:
    """A selection as the paged kernel's inputs (`cpu_attention.attend_decode_bf16`): page tables and slot
    counts, [B, S] and [B] where every row's KV heads share one choice (`shared`: select_per="row"), else
    one table per (row, KV head), [B, kv_heads, S] and [B, kv_heads]. The chosen pages are in page order
    and only a row's last page is partly filled, so slots [0, n) of a shorter table are exactly the chosen
    slots (padding, page 0 with 0 slots, sorts after them)."""
    pages, slots = (sel.pages[:, 0], sel.slots[:, 0]) if shared else (sel.pages, sel.slots)
    lens = slots.sum(-1).numpy().astype(np.int64) if sel.lens is None else sel.lens[:, 0] if shared else sel.lens
    return pages.contiguous().numpy(), np.ascontiguousarray(lens)
