"""The routed experts of an MoE layer in Triton, grouped by expert with no host sync and static shapes, so a
CUDA graph can capture it and each active expert's weights are read once per step (`engine.moe` chooses it:
"triton"; `engine.moe.grouped` and `per_token` are its torch references, tests/unit/test_moe_triton.py).

Order of `moe_grouped(h, ids, weights, gate_up, down, first_expert)`:
  1. `align` (torch ops a graph captures: sort, searchsorted, cumsum, scatter): the step's T * k assignments
     sorted by expert (tokens ascending within one), each held expert's rows padded to a multiple of BLOCK_M
     in a worst-case list of row blocks (its length depends on T, k and the experts held only); each block
     names its expert, blocks past the last one name none. Assignments to experts another expert-parallel
     rank holds sort last and take no block.
  2. `_gate_up_kernel`, programs (row block, column block of the expert's width): the block's token rows
     gathered from h times gate and up rows, SwiGLU fused, the activations stored by padded row.
  3. `_down_kernel`, programs (row block, column block of hidden): activations times down, each row scaled
     by its routing weight, stored by assignment (token * k + slot).
  4. `_combine_kernel`, a program per (token, hidden block): its k slots summed in ascending expert order,
     rounded to h's dtype after each add as `grouped`'s index_add_ does: no atomics, deterministic.
Rounding follows the torch path: linear outputs, silu, the weighted rows rounded to h's dtype; products in
float32 (IEEE for float32, so no TF32). Configs are fixed by shape (`_config`), no autotuning.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Triton's interpreter (CPU tests) multiplies bfloat16 bits in tl.dot as integers (operands go float32 there)
# and truncates float32 -> bfloat16 casts (round-to-nearest-even there from the bits, `_round`)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
COMBINE_BLOCK = 256  # hidden columns per combine program


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _round(x, P, BITS: tl.constexpr):
    """float32 x rounded to the dtype P points to (nearest even), as float32; BITS: bfloat16 by hand on the
    bits (under the interpreter)."""
    if BITS:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        y = b.to(tl.float32, bitcast=True)
    else:
        y = x.to(P.dtype.element_ty).to(tl.float32)
    return y


@triton.jit
def _gate_up_kernel(X, GU, ROWS, BLOCK_EXPERT, ACT, n_rows, s_x, s_ge, s_gn, s_a,
                    hidden: tl.constexpr, inter: tl.constexpr, TOPK: tl.constexpr, E: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    IEEE: tl.constexpr, UPCAST: tl.constexpr, BITS: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(BLOCK_EXPERT + pid_m)
    if e >= E:  # a block past the last expert's rows
        return
    r = pid_m * BM + tl.arange(0, BM)
    row = tl.load(ROWS + r)  # [BM] assignment index; n_rows marks padding
    ok = row < n_rows
    tok = (row // TOPK).to(tl.int64)
    cols = pid_n * BN + tl.arange(0, BN)  # [BN] columns of the expert's intermediate width
    c_ok = cols < inter
    w = GU + e.to(tl.int64) * s_ge
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, hidden, BK):
        kk = k0 + tl.arange(0, BK)
        k_ok = kk < hidden
        a = tl.load(X + tok[:, None] * s_x + kk[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        w_ok = k_ok[:, None] & c_ok[None, :]
        wg = tl.load(w + cols[None, :].to(tl.int64) * s_gn + kk[:, None], mask=w_ok, other=0.0)  # [BK, BN]
        wu = tl.load(w + (cols[None, :] + inter).to(tl.int64) * s_gn + kk[:, None], mask=w_ok, other=0.0)
        acc_g = _dot(a, wg, acc_g, IEEE, UPCAST)
        acc_u = _dot(a, wu, acc_u, IEEE, UPCAST)
    g = _round(acc_g, ACT, BITS)  # rounded where torch's linear output is
    u = _round(acc_u, ACT, BITS)
    s = _round(g / (1.0 + tl.exp(-g)), ACT, BITS)  # silu, rounded as F.silu's output
    act = _round(s * u, ACT, BITS).to(ACT.dtype.element_ty)  # [BM, BN]
    tl.store(ACT + r[:, None].to(tl.int64) * s_a + cols[None, :], act, mask=c_ok[None, :])


@triton.jit
def _down_kernel(ACT, DOWN, ROWS, BLOCK_EXPERT, WEIGHTS, Y, n_rows, s_a, s_de, s_dn, s_y,
                 hidden: tl.constexpr, inter: tl.constexpr, E: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 IEEE: tl.constexpr, UPCAST: tl.constexpr, BITS: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(BLOCK_EXPERT + pid_m)
    if e >= E:
        return
    r = pid_m * BM + tl.arange(0, BM)
    row = tl.load(ROWS + r)
    ok = row < n_rows
    cols = pid_n * BN + tl.arange(0, BN)  # [BN] hidden columns
    c_ok = cols < hidden
    w = DOWN + e.to(tl.int64) * s_de
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, inter, BK):
        kk = k0 + tl.arange(0, BK)
        k_ok = kk < inter
        a = tl.load(ACT + r[:, None].to(tl.int64) * s_a + kk[None, :], mask=k_ok[None, :], other=0.0)  # [BM, BK]
        wd = tl.load(w + cols[None, :].to(tl.int64) * s_dn + kk[:, None], mask=k_ok[:, None] & c_ok[None, :],
                     other=0.0)  # [BK, BN]
        acc = _dot(a, wd, acc, IEEE, UPCAST)
    wt = tl.load(WEIGHTS + row, mask=ok, other=0.0).to(tl.float32)  # [BM] routing weights (float32 or h's)
    y = _round(_round(acc, Y, BITS) * wt[:, None], Y, BITS).to(Y.dtype.element_ty)  # (expert(x) * w).to(dtype)
    tl.store(Y + row[:, None].to(tl.int64) * s_y + cols[None, :], y, mask=ok[:, None] & c_ok[None, :])


@triton.jit
def _combine_kernel(Y, IDS, ORDER, OUT, first, hidden, s_y, s_o, TOPK: tl.constexpr, E: tl.constexpr,
                    BH: tl.constexpr, BITS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    c_ok = cols < hidden
    acc = tl.zeros((BH,), dtype=tl.float32)
    for j in tl.static_range(TOPK):  # the token's slots in ascending expert order
        slot = tl.load(ORDER + t * TOPK + j)
        e = tl.load(IDS + t * TOPK + slot) - first
        held = (e >= 0) & (e < E)  # another rank's expert adds nothing
        y = tl.load(Y + (t * TOPK + slot) * s_y + cols, mask=c_ok & held, other=0.0).to(tl.float32)
        acc = _round(acc + y, OUT, BITS)  # rounded per add, as index_add_ in dtype
    tl.store(OUT + t * s_o + cols, acc.to(OUT.dtype.element_ty), mask=c_ok)


def max_blocks(assignments: int, experts: int, block_m: int) -> int:
    """Row blocks the worst routing needs: each active expert (at most min(experts, assignments)) pads its
    rows up to a multiple of block_m."""
    return (assignments + min(experts, assignments) * (block_m - 1)) // block_m


def align(ids: torch.Tensor, first_expert: int, experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] global expert ids -> (rows [blocks * block_m] int32: each padded row's assignment index
    t * k + j, T * k for padding; block_expert [blocks] int32: each block's local expert, `experts` for none).
    Device ops only, shapes from (T, k, experts, block_m): nothing is read back to the host."""
    n, dev = ids.numel(), ids.device
    blocks = max_blocks(n, experts, block_m)
    local = ids.reshape(-1) - first_expert  # [n]
    key = torch.where((local >= 0) & (local < experts), local, experts)  # another rank's experts sort last
    sorted_key, order = torch.sort(key, stable=True)  # [n] by expert, tokens ascending within one
    bounds = torch.searchsorted(sorted_key, torch.arange(experts + 1, device=dev, dtype=key.dtype))  # [E + 1]
    counts = bounds[1:] - bounds[:-1]  # [E] rows of each expert
    padded_end = torch.cumsum((counts + block_m - 1) // block_m * block_m, 0)  # [E]
    padded_start = padded_end - (counts + block_m - 1) // block_m * block_m
    e = sorted_key.clamp(max=experts - 1)
    pos = torch.arange(n, device=dev)
    dest = padded_start.index_select(0, e) + pos - bounds.index_select(0, e)  # [n] each one's padded row
    dest = torch.where(sorted_key < experts, dest, blocks * block_m + pos)  # not held: past the list, dropped
    rows = torch.full((blocks * block_m + n,), n, dtype=torch.int32, device=dev)
    rows.scatter_(0, dest, order.to(torch.int32))
    starts = torch.arange(blocks, device=dev, dtype=padded_end.dtype) * block_m
    block_expert = torch.searchsorted(padded_end, starts, right=True).to(torch.int32)  # [blocks]
    return rows[:blocks * block_m], block_expert


def _config(assignments: int, experts: int, hidden: int, inter: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps), fixed by shape: BLOCK_M near the mean rows an expert gets
    (16 at decode, where padding would be read as weights are), N and K tiles no wider than the matrices."""
    mean = assignments / experts
    bm = 16 if mean <= 16 else 32 if mean <= 64 else 64
    bn = min(64, max(16, triton.next_power_of_2(min(hidden, inter))))
    bk = min(64, max(16, triton.next_power_of_2(min(hidden, inter))))
    return bm, bn, bk, 4


def moe_grouped(h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, first_expert: int = 0) -> torch.Tensor:
    """h [T, H], ids / weights [T, k] (global expert ids; ids outside [first_expert, first_expert + E) add
    nothing), gate_up [E, 2I, H] (gate rows, then up rows), down [E, H, I] -> [T, H] in h's dtype: each
    token's held experts' weight * down(silu(gate) * up), summed in ascending expert order."""
    t, k = ids.shape
    experts, two_inter, hidden = gate_up.shape
    inter = two_inter // 2
    assert h.shape == (t, hidden) and weights.shape == (t, k) and down.shape == (experts, hidden, inter)
    out = torch.empty_like(h)
    if t == 0:
        return out
    # the kernels take row strides; only rows must be dense (a copy of every expert's weights each step would
    # cost more than the step): the layer's stacked weights already are
    h, gate_up, down = (x if x.stride(-1) == 1 else x.contiguous() for x in (h, gate_up, down))
    ids, weights = ids.contiguous(), weights.contiguous()  # [T, k], indexed as t * k + slot
    n = t * k
    bm, bn, bk, warps = _config(n, experts, hidden, inter)
    rows, block_expert = align(ids, first_expert, experts, bm)
    blocks = block_expert.shape[0]
    bits = INTERPRETED and h.dtype == torch.bfloat16
    flags = dict(IEEE=h.dtype == torch.float32, UPCAST=INTERPRETED, BITS=bits)
    act = torch.empty((blocks * bm, inter), dtype=h.dtype, device=h.device)  # [padded rows, I]
    _gate_up_kernel[(blocks, triton.cdiv(inter, bn))](
        h, gate_up, rows, block_expert, act, n, h.stride(0), gate_up.stride(0), gate_up.stride(1), act.stride(0),
        hidden=hidden, inter=inter, TOPK=k, E=experts, BM=bm, BN=bn, BK=bk, **flags, num_warps=warps)
    y = torch.empty((n, hidden), dtype=h.dtype, device=h.device)  # [T * k, H]: rows of other ranks' never written
    _down_kernel[(blocks, triton.cdiv(hidden, bn))](
        act, down, rows, block_expert, weights, y, n, act.stride(0), down.stride(0), down.stride(1), y.stride(0),
        hidden=hidden, inter=inter, E=experts, BM=bm, BN=bn, BK=bk, **flags, num_warps=warps)
    order = torch.sort(ids, dim=1, stable=True).indices  # [T, k] each token's slots by ascending expert
    bh = min(COMBINE_BLOCK, triton.next_power_of_2(hidden))
    _combine_kernel[(t, triton.cdiv(hidden, bh))](y, ids, order, out, first_expert, hidden, y.stride(0),
                                                  out.stride(0), TOPK=k, E=experts, BH=bh, BITS=bits, num_warps=4)
    return out
