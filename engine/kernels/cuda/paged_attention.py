"""Paged attention on CUDA in Triton: queries of a few tokens per row read K/V where they lie in the page pool.

Who calls it: `RawKVBackend` (engine/kv_cache/raw.py) for decode groups (one query per row) and verify
groups (1 + k queries per row) on CUDA, eagerly or inside a captured CUDA graph (engine/kernels/cuda/
graph_decode.py). Reference: `engine.kernels.reference.paged_attention` (plain torch, the test oracle).

One program per (row, KV head, split):
  - the query heads of one KV head are its rows ([q_len * group] queries, padded to 16 for `tl.dot`), so
    each KV page is read once for all of them (GQA);
  - the row's context is cut into `splits` equal token ranges read by different programs (flash-decoding /
    Lean Attention): a batch of 1 at 8 KV heads is only 8 programs, too few to fill 132 SMs, so splits make
    it `8 x splits`. Each split writes its normalised partial output and log-sum-exp; `_combine` merges them.
    With one split the program writes the output itself.
  - pages are addressed through the block table, `BLOCK_N` tokens (several pages) per iteration; a query
    row at offset qi of q_len sees keys [0, ctx_len - (q_len - 1 - qi)) (causal within the new tokens).
  - rows with ctx_len 0 (padding rows of a graph bucket) write zeros and read nothing.
Page formats: raw pages in the compute dtype; int8 cells (engine/kv_cache/quantized.py: values + a float16
scale per token and head), dequantized as they load; per-(row, KV head) page lists (Quest's choice: a block
table [batch, kv_heads, S] and lengths [batch, kv_heads]), so each KV head reads only its chosen pages.
Shapes stay static for a given (batch, splits): CUDA graphs capture it once per batch bucket.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Triton's interpreter (CPU tests; triton.jit reads the variable at decoration too): its range() cannot take a
# loaded bound and its tl.dot multiplies bfloat16 bits as integers, so loops become whiles and dots float32.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_N = 64  # keys per inner iteration (4 pages of 16)
MIN_SPLIT_TOKENS = 256  # a split shorter than this costs more in the combine than it saves


@triton.jit
def _block(q, Q, K, V, KS, VS, BT, b, h, n0, end, limit, scale, m_i, l_i, acc, s_kp, s_kt, s_kh, s_vp, s_vt, s_vh,
           s_bt, s_bh, s_bc, d, d_ok, D: tl.constexpr, PS: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr,
           UPCAST: tl.constexpr, QUANT: tl.constexpr):
    """Keys [n0, n0 + BLOCK) of one row and KV head folded into the running softmax (m_i, l_i, acc)."""
    n = n0 + tl.arange(0, BLOCK)
    n_ok = n < end
    page = tl.load(BT + b.to(tl.int64) * s_bt + h * s_bh + (n // PS) * s_bc, mask=n_ok, other=0).to(tl.int64)
    k_off = page * s_kp + (n % PS) * s_kt + h * s_kh
    v_off = page * s_vp + (n % PS) * s_vt + h * s_vh
    kv_ok = n_ok[:, None] & d_ok[None, :]
    k = tl.load(K + k_off[:, None] + d[None, :], mask=kv_ok, other=0.0)  # [BLOCK, D_PAD]
    if QUANT:  # int8 cells: values, then a float16 scale per (token, head) at byte D of the cell
        k_scale = tl.load(KS + (k_off + D) // 2, mask=n_ok, other=0.0).to(tl.float32)
        k = k.to(tl.float32) * k_scale[:, None]
        if not UPCAST:
            k = k.to(Q.dtype.element_ty)
    if UPCAST:
        k = k.to(tl.float32)
    if IEEE:
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))
    scores = scores * scale  # [M_PAD, BLOCK] float32
    seen = (n[None, :] < limit[:, None]) & n_ok[None, :]
    scores = tl.where(seen, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(V + v_off[:, None] + d[None, :], mask=kv_ok, other=0.0)
    if QUANT:
        v_scale = tl.load(VS + (v_off + D) // 2, mask=n_ok, other=0.0).to(tl.float32)
        v = v.to(tl.float32) * v_scale[:, None]
        if not UPCAST:
            v = v.to(Q.dtype.element_ty)
    pv = p.to(Q.dtype.element_ty)  # rounded to the compute dtype, as the tensor cores take it
    if UPCAST:
        pv = pv.to(tl.float32)
        v = v.to(tl.float32)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(pv, v)
    return m_new, l_i, acc


@triton.jit
def _split_kernel(Q, K, V, KS, VS, BT, LENS, OUT, OPART, LSE, scale,
                  s_qt, s_qh, s_kp, s_kt, s_kh, s_vp, s_vt, s_vh, s_bt, s_bh, s_bc, s_lb, s_lh, s_ot, s_oh,
                  s_pt, s_ph, s_ps,
                  GROUP: tl.constexpr, QLEN: tl.constexpr, M_PAD: tl.constexpr, D: tl.constexpr,
                  D_PAD: tl.constexpr, PS: tl.constexpr, BLOCK: tl.constexpr, SPLITS: tl.constexpr,
                  IEEE: tl.constexpr, FOR_LOOP: tl.constexpr, UPCAST: tl.constexpr, QUANT: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    ctx = tl.load(LENS + b * s_lb + h * s_lh).to(tl.int32)
    m_idx = tl.arange(0, M_PAD)
    qi = m_idx // GROUP
    head = h * GROUP + m_idx % GROUP
    row_ok = m_idx < GROUP * QLEN
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    tok = b * QLEN + qi  # packed token of each query row
    q = tl.load(Q + tok[:, None].to(tl.int64) * s_qt + head[:, None] * s_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    limit = ctx - (QLEN - 1 - qi)  # [M_PAD] keys each query row may see
    per_split = tl.cdiv(tl.cdiv(ctx, SPLITS), BLOCK) * BLOCK
    start = s * per_split
    end = tl.minimum(start + per_split, ctx)
    m_i = tl.full([M_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([M_PAD], tl.float32)
    acc = tl.zeros([M_PAD, D_PAD], tl.float32)
    if FOR_LOOP:  # compiled: a for loop the compiler can pipeline
        for n0 in range(start, end, BLOCK):
            m_i, l_i, acc = _block(q, Q, K, V, KS, VS, BT, b, h, n0, end, limit, scale, m_i, l_i, acc, s_kp, s_kt,
                                   s_kh, s_vp, s_vt, s_vh, s_bt, s_bh, s_bc, d, d_ok, D, PS, BLOCK, IEEE, UPCAST, QUANT)
    else:  # the interpreter
        n0 = start
        while n0 < end:
            m_i, l_i, acc = _block(q, Q, K, V, KS, VS, BT, b, h, n0, end, limit, scale, m_i, l_i, acc, s_kp, s_kt,
                                   s_kh, s_vp, s_vt, s_vh, s_bt, s_bh, s_bc, d, d_ok, D, PS, BLOCK, IEEE, UPCAST, QUANT)
            n0 += BLOCK
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if SPLITS == 1:
        tl.store(OUT + tok[:, None].to(tl.int64) * s_ot + head[:, None] * s_oh + d[None, :],
                 o.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        base = tok.to(tl.int64) * s_pt + head * s_ph + s * s_ps
        tl.store(OPART + base[:, None] + d[None, :], o, mask=row_ok[:, None] & d_ok[None, :])
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
        # LSE [tokens, heads, splits]: the partial output's layout without its last axis
        tl.store(LSE + tok.to(tl.int64) * (s_pt // D_PAD) + head * (s_ph // D_PAD) + s, lse, mask=row_ok)


@triton.jit
def _combine_kernel(OPART, LSE, OUT, s_pt, s_ph, s_ps, s_ot, s_oh,
                    D: tl.constexpr, D_PAD: tl.constexpr, SPLITS: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, D_PAD)
    lse = tl.load(LSE + t.to(tl.int64) * (s_pt // D_PAD) + h * (s_ph // D_PAD) + s)  # [SPLITS]
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)  # splits that saw nothing weigh 0
    total = tl.sum(w, 0)
    part = tl.load(OPART + t.to(tl.int64) * s_pt + h * s_ph + s[:, None] * s_ps + d[None, :])  # [SPLITS, D_PAD]
    o = tl.sum(part * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(OUT + t.to(tl.int64) * s_ot + h * s_oh + d, o.to(OUT.dtype.element_ty), mask=d < D)


def num_splits(batch: int, kv_heads: int, max_ctx: int, sm_count: int) -> int:
    """Splits per row so that batch x kv_heads x splits programs fill the GPU about twice over, each split
    reading at least MIN_SPLIT_TOKENS keys; a power of two (the combine's arange)."""
    want = max(1, -(-2 * sm_count // max(1, batch * kv_heads)))
    most = max(1, max_ctx // MIN_SPLIT_TOKENS)
    n = min(want, most)
    return 1 << (n.bit_length() - 1) if n & (n - 1) else n


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor,
                    ctx_lens: torch.Tensor, scale: float, q_len: int = 1, splits: int = 1,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Pools of uint8 cells [..., head_dim + 2] are int8 pages (engine/kv_cache/quantized.py's layout:
    values, then a float16 scale per token and head), dequantized as they load."""
    """q: [batch * q_len, q_heads, head_dim] (row-major: a row's q_len queries together); k_pool, v_pool:
    [num_pages, page_size, kv_heads, head_dim]; block_table: [batch, max_pages] page ids (int32/int64, any
    strides: a graph's table is column-major);
    ctx_lens: [batch] slots each row attends to after this step's writes (0: a padding row) -> out, q's
    shape and dtype. Sparse (Quest) choices: block_table [batch, kv_heads, S] (each KV head's chosen pages in
    page order, only the last one partly filled) and ctx_lens [batch, kv_heads] (their slots), one query a row."""
    tokens, heads, dim = q.shape
    batch = block_table.shape[0]
    assert tokens == batch * q_len, (tokens, batch, q_len)
    per_head = block_table.dim() == 3  # a page table per (row, KV head): sparse attention's choice
    assert not per_head or (q_len == 1 and ctx_lens.dim() == 2), "per-KV-head pages: one query a row"
    s_bh = block_table.stride(1) if per_head else 0
    s_lh = ctx_lens.stride(1) if ctx_lens.dim() == 2 else 0
    _, ps, kv_heads, _ = k_pool.shape
    group = heads // kv_heads
    quant = k_pool.dtype == torch.uint8
    if quant:  # the same bytes as int8 values and as float16 scales (cells of an even byte count)
        assert k_pool.shape[-1] >= dim + 2 and k_pool.shape[-1] % 2 == 0, (k_pool.shape, dim)  # (cells may be padded)
        k_pool, k_scales, v_pool, v_scales = (k_pool.view(torch.int8), k_pool.view(torch.float16),
                                              v_pool.view(torch.int8), v_pool.view(torch.float16))
    else:
        k_scales, v_scales = k_pool, v_pool  # unused
    assert k_pool.stride(-1) == 1 and v_pool.stride(-1) == 1 and q.stride(-1) == 1
    m_pad = max(16, triton.next_power_of_2(group * q_len))
    d_pad = max(16, triton.next_power_of_2(dim))
    if out is None:
        out = torch.empty_like(q)
    if splits > 1:
        part = torch.empty((tokens, heads, splits, d_pad), dtype=torch.float32, device=q.device)
        lse = torch.empty((tokens, heads, splits), dtype=torch.float32, device=q.device)
        sp = part.stride()
    else:
        part = lse = out  # unused by the kernel when SPLITS == 1
        sp = (0, 0, 0)
    ieee = q.dtype == torch.float32
    _split_kernel[(batch, kv_heads, splits)](
        q, k_pool, v_pool, k_scales, v_scales, block_table, ctx_lens, out, part, lse, scale,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2), block_table.stride(0), s_bh, block_table.stride(-1),
        ctx_lens.stride(0), s_lh, out.stride(0), out.stride(1),
        sp[0], sp[1], sp[2],
        GROUP=group, QLEN=q_len, M_PAD=m_pad, D=dim, D_PAD=d_pad, PS=ps, BLOCK=BLOCK_N, SPLITS=splits, IEEE=ieee,
        FOR_LOOP=not INTERPRETED, UPCAST=INTERPRETED, QUANT=quant,
        num_warps=4)
    if splits > 1:
        _combine_kernel[(tokens, heads)](part, lse, out, sp[0], sp[1], sp[2], out.stride(0), out.stride(1),
                                         D=dim, D_PAD=d_pad, SPLITS=splits, num_warps=2)
    return out
