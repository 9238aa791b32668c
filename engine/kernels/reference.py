"""Plain torch references for the engine's kernels: the oracles their tests compare against.

`paged_attention`: what engine/kernels/cuda/paged_attention.py computes, one row at a time, in float32.
"""
from __future__ import annotations

import torch


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor,
                    ctx_lens: torch.Tensor, scale: float, q_len: int = 1) -> torch.Tensor:
    """q: [batch * q_len, q_heads, head_dim]; pools [num_pages, page_size, kv_heads, head_dim]; block_table
    [batch, pages]; ctx_lens [batch] -> [batch * q_len, q_heads, head_dim] in q's dtype. Query qi of a row
    sees keys [0, ctx_len - (q_len - 1 - qi)); a row with ctx_len 0 gives zeros."""
    tokens, heads, dim = q.shape
    _, ps, kv_heads, _ = k_pool.shape
    group = heads // kv_heads
    out = torch.zeros(tokens, heads, dim, dtype=torch.float32)
    for b, n in enumerate(ctx_lens.tolist()):
        if n == 0:
            continue
        pages = block_table[b, :-(-n // ps)].long().cpu()
        k = k_pool.cpu()[pages].reshape(-1, kv_heads, dim)[:n].float()  # [n, kv_heads, dim]
        v = v_pool.cpu()[pages].reshape(-1, kv_heads, dim)[:n].float()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [n, heads, dim]
        qs = q[b * q_len:(b + 1) * q_len].cpu().float()  # [q_len, heads, dim]
        scores = torch.einsum("qhd,nhd->hqn", qs, k) * scale
        seen = torch.arange(n)[None, :] < (n - (q_len - 1 - torch.arange(q_len)))[:, None]  # [q_len, n]
        scores = scores.masked_fill(~seen, float("-inf"))
        out[b * q_len:(b + 1) * q_len] = torch.einsum("hqn,nhd->qhd", scores.softmax(-1), v)
    return out.to(q.dtype)


def rope_write(qkv, cos, sin_signed, k_pool, v_pool, slots, q_heads: int, kv_heads: int) -> torch.Tensor:
    """What the model's torch path does (engine/rope.apply_rotary, then the backend's write)."""
    t, dim = qkv.shape[0], cos.shape[-1]
    qk = qkv[:, :(q_heads + kv_heads) * dim].view(t, q_heads + kv_heads, dim)
    qk = qk * cos[:, None] + qk.roll(dim // 2, dims=-1) * sin_signed[:, None]
    k_pool.view(-1, kv_heads, dim).index_copy_(0, slots, qk[:, q_heads:].to(k_pool.dtype))
    v = qkv[:, (q_heads + kv_heads) * dim:].reshape(t, kv_heads, dim)
    v_pool.view(-1, kv_heads, dim).index_copy_(0, slots, v.to(v_pool.dtype))
    return qk[:, :q_heads].contiguous()


def add_rms_norm(x, delta, weight, eps: float):
    """(rms_norm(x + delta) * weight, x + delta), as the torch path's residual add then F.rms_norm."""
    res = x if delta is None else x + delta
    return torch.nn.functional.rms_norm(res, (res.shape[-1],), weight, eps), res


def silu_mul(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def quest_bounds(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, table: torch.Tensor, lens: torch.Tensor,
                 page_size: int, gqa_sum: bool) -> torch.Tensor:
    """What engine/kernels/cuda/quest.py's bounds kernel computes: [B, kv_heads, P] float32, the upper bound
    of q . k over each page column's keys (q+ . hi + q- . lo per query head, then max or sum over a KV
    head's query heads); -inf past a row's pages."""
    b, hq, d = q.shape
    h = lo.shape[1]
    qf = q.float().cpu().view(b, h, hq // h, d)
    cols = table.long().cpu()
    lo_p, hi_p = lo.float().cpu()[cols], hi.float().cpu()[cols]  # [B, P, kv_heads, D]
    per_head = (torch.einsum("bphd,bhgd->bhpg", hi_p, qf.clamp(min=0))
                + torch.einsum("bphd,bhgd->bhpg", lo_p, qf.clamp(max=0)))
    scores = per_head.sum(-1) if gqa_sum else per_head.amax(-1)  # [B, kv_heads, P]
    npg = (lens.long().cpu() + page_size - 1) // page_size
    valid = torch.arange(table.shape[1]).view(1, 1, -1) < npg.view(-1, 1, 1)
    return scores.masked_fill(~valid, float("-inf"))
