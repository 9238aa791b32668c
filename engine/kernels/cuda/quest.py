"""Quest's page choice at static shapes, on the device: what a CUDA-graph decode step runs for sparse attention.

Who calls it: `RawKVBackend._attend_sparse` for a group that carries device lengths and no per-row configs
(the static decode step of engine/kernels/cuda/graph_decode.py); engine/kv_cache/sparse.py's `select` is the
eager path and the reference this must agree with.

Per layer (or per selection layer; the others reuse the step's choice, as sparse.choose does):
  1. `quest_bounds` (Triton): for every page column of every row and KV head, the upper bound of q . k over
     the page from its summaries, sum over channels of max(q * lo, q * hi), reduced over the KV head's query
     heads by max or sum (the config's `gqa`); columns past a row's pages get -inf. Reads each summary once.
  2. torch, fixed shapes: sinks and the recent window forced (+inf), one choice per row when select_per is
     "row", the top `static_pages(cfg)` columns, in page order; columns past a row's pages (rows shorter than
     the choice) become padding (page 0, 0 slots); each (row, KV head) gets its page list and slot count,
     which the paged kernel reads in place. No host sync: lengths come from the graph's static buffer.
A row whose pages all fit in the choice reads every page, as the eager path's full attention does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_P = 32  # page columns per program


def static_pages(cfg, page_size: int) -> int:
    """Pages a row reads when it chooses (sparse._plan's per-row count): sinks, the budget, the recent
    window's pages and one more (a window straddles a page boundary)."""
    return cfg.sink_pages + cfg.budget // page_size + -(-cfg.recent // page_size) + 1


@triton.jit
def _bounds_kernel(Q, LO, HI, BT, LENS, OUT, s_qb, s_qh, s_lp, s_lh, s_bt, s_bc, s_ob, s_oh,
                   GROUP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, PS: tl.constexpr,
                   BLOCK: tl.constexpr, SUM: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    j = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    n = tl.load(LENS + b).to(tl.int32)
    ok = j < (n + PS - 1) // PS
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    page = tl.load(BT + b.to(tl.int64) * s_bt + j * s_bc, mask=ok, other=0).to(tl.int64)
    off = page[:, None] * s_lp + h * s_lh + d[None, :]
    lo = tl.load(LO + off, mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # [BLOCK, D_PAD]
    hi = tl.load(HI + off, mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK], tl.float32)
    for g in tl.static_range(GROUP):
        q = tl.load(Q + b.to(tl.int64) * s_qb + (h * GROUP + g) * s_qh + d, mask=d_ok, other=0.0).to(tl.float32)
        bound = tl.sum(tl.maximum(hi * q[None, :], lo * q[None, :]), 1)  # [BLOCK]
        best = tl.maximum(best, bound)
        total += bound
    score = total if SUM else best
    score = tl.where(ok, score, float("-inf"))
    tl.store(OUT + b.to(tl.int64) * s_ob + h * s_oh + j, score)  # (OUT is padded to whole blocks)


def quest_bounds(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, table: torch.Tensor, lens: torch.Tensor,
                 page_size: int, gqa_sum: bool) -> torch.Tensor:
    """q [B, q_heads, D]; lo/hi [num_pages, kv_heads, D]; table [B, P] page ids (any strides); lens [B] ->
    scores [B, kv_heads, P] float32 (-inf past a row's pages)."""
    b, hq, d = q.shape
    kv_heads = lo.shape[1]
    p = table.shape[1]
    blocks = triton.cdiv(p, BLOCK_P)
    out = torch.empty((b, kv_heads, blocks * BLOCK_P), dtype=torch.float32, device=q.device)
    assert lo.stride(-1) == 1 and q.stride(-1) == 1 and lo.stride() == hi.stride()
    _bounds_kernel[(b, kv_heads, blocks)](
        q, lo, hi, table, lens, out, q.stride(0), q.stride(1), lo.stride(0), lo.stride(1), table.stride(0),
        table.stride(1), out.stride(0), out.stride(1),
        GROUP=hq // kv_heads, D=d, D_PAD=max(16, triton.next_power_of_2(d)), PS=page_size, BLOCK=BLOCK_P,
        SUM=gqa_sum, num_warps=4)
    return out[:, :, :p]


def choose_static(cfg, lo: torch.Tensor, hi: torch.Tensor, q: torch.Tensor, table: torch.Tensor,
                  lens: torch.Tensor, page_size: int, plan: dict, layer: int):
    """One layer's pages for a static decode group: (pages [B, kv_heads, S], slots read [B, kv_heads]
    int32), or None for a dense layer. `plan` lives for the step: the layer-independent masks, made once,
    and the latest choice, which layers that do not choose reuse."""
    if layer < cfg.dense_layers:
        return None
    if "chosen" in plan and not cfg.chooses_at(layer):
        return plan["chosen"]
    if "forced" not in plan:
        plan.update(_masks(cfg, table, lens, page_size))
    scores = quest_bounds(q, lo, hi, table, lens, page_size, cfg.gqa == "sum")  # [B, kv_heads, P]
    scores = scores.masked_fill(plan["forced"], float("inf"))
    if cfg.select_per == "row":  # one choice for all KV heads of a row (inf and -inf survive the sum)
        scores = scores.sum(1, keepdim=True).expand_as(scores)
    s = min(static_pages(cfg, page_size), scores.shape[-1])
    idx = scores.topk(s, dim=-1).indices.sort(dim=-1).values  # [B, kv_heads, S] columns, in page order
    last = plan["last"]  # [B, 1, 1]: each row's last page column
    b, h = scores.shape[:2]
    pages = table.unsqueeze(1).expand(b, h, table.shape[1]).gather(2, idx).masked_fill(idx > last, 0)
    slots = torch.where(idx == last, plan["tail"], page_size).masked_fill(idx > last, 0)
    plan["chosen"] = (pages, slots.sum(-1, dtype=torch.int32))
    return plan["chosen"]


def _masks(cfg, table: torch.Tensor, lens: torch.Tensor, ps: int) -> dict:
    """Sinks and the recent window forced (all pages, for rows below min_context); each row's last page
    column and its filled slots."""
    n = lens.long().view(-1, 1)  # [B, 1]
    j = torch.arange(table.shape[1], device=table.device).view(1, -1)
    first_recent = (n - cfg.recent).clamp(min=0) // ps
    npg = (n + ps - 1) // ps
    forced = ((j < cfg.sink_pages) | (j >= first_recent) | (n < cfg.min_context)) & (j < npg)  # [B, P]
    return {"forced": forced.unsqueeze(1), "last": (npg - 1).view(-1, 1, 1),
            "tail": (n - (npg - 1) * ps).view(-1, 1, 1)}


def fits(cfg, ctx_lens: list[int], page_size: int, max_pages: int) -> bool:
    """Whether the static choice serves these rows as the eager one would: a row below min_context reads
    every page, so its pages must fit in the choice."""
    s = min(static_pages(cfg, page_size), max_pages)
    return all(n >= cfg.min_context or -(-n // page_size) <= s for n in ctx_lens)


