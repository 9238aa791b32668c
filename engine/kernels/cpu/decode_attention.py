"""Paged decode attention for bfloat16 on CPU, compiled with numba: one query per sequence, K/V read
straight from the page pools through the page table (no gather, no dense copy).

Why: at batch 16 and context ~300 the decode step's attention is ~30% of the step (bench `step16`). Torch's
SDPA needs K/V gathered out of the pages into one padded tensor per group, then runs a small GEMM per
(sequence, head): ~5 us each, mostly call overhead, and it reads the gathered copy once more. This kernel
reads each sequence's pages once, for every head of a row at a time, and needs no padding for rows of
different lengths. Measured on the development machine (one thread, SmolLM2 shapes, thread CPU time, in
one process alternating with the SDPA path): a layer of 16 rows x ~300 slots ~1.0 ms (scores ~0.42,
softmax ~0.12, weighted sum ~0.52); decode step at batch 4 72.4 vs 78.6 ms, at batch 16 77.3 vs 78.7 ms
(SDPA reading the dense copies of `dense_decode.py` there); 16 ragged requests (bench `batch`) 12.8-14.5 s
vs 14.7-15.8 s. float32 keeps SDPA.

    attend_decode_bf16(q_bits, k_pool_bits, v_pool_bits, page_index, ctx_lens, scale) -> out bits
    # q [B, q_heads, head_dim]; pools [num_pages, page_size, kv_heads, head_dim]; page_index [B, >= pages]
    # (int64, padded); ctx_lens [B] (slots [0, n) of row b are attended); out [B, q_heads, head_dim]
    # or one table per (row, KV head): page_index [B, kv_heads, >= pages], ctx_lens [B, kv_heads]
    attend_decode_reference(q, k_pool, v_pool, page_index, ctx_lens, scale)  # torch, float64: the oracle

A table per (row, KV head) is what sparse attention's per-KV-head page choice (`kv_cache/sparse.py`) hands
in: each KV head reads its own chosen pages in place (numba: `_decode_heads_kernel`, one KV head's slice
of each slot row at a time; C: the same call with `tables` = kv_heads).

Math: scores, softmax and the weighted sum in float32; exp is a polynomial (`_exp`, relative error
< 5e-6, far under bf16's 4e-3) so LLVM can vectorize it (numba calls libm's expf one value at a time);
the output rounded once to bf16. Grouped-query heads: q head i reads KV head i // (q_heads // kv_heads).
Used by `RawKVBackend` for decode groups of bf16 pages on CPU (`kv_cache/raw.py`); float32 keeps
SDPA (its logits must match transformers'), as do groups that record attention (eviction observers).
At head_dim 64 (from `NATIVE_MIN_ROWS` rows: 1), where the CPU has AVX512-BF16 and a C compiler is
found (`engine.kernels.cpu.native`), the same call runs the C kernel of `engine/kernels/cpu/csrc/decode_attention_bf16.c`
instead (same contract; its module map says how). On the AMD EPYC machine of stop 20, SmolLM2's heads,
16 rows x ~300 slots: 0.17 vs 0.39 ms a layer with the pages in cache, 0.53 vs 0.79 ms read from memory
(`bench/engine/attention_bench.py`); the batch-16 decode step 69.1 vs 75.3 ms (interleaved in one process).
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from engine.kernels.cpu import native as cpu_native
from engine.kernels.cpu.numba_kernels import _bf16_to_f32, _jit, _round_bf16


@intrinsic
def _i32_as_f32(typingctx, value):
    """int32 bits -> the float32 they encode."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


# 2**f = e**(f ln 2) on [0, 1): Taylor terms to degree 7 (the first omitted one is < 1.3e-6 relative;
# measured over [-87, 0]: < 4e-6 with float32 rounding, tested < 5e-6).
_C = [np.float32(math.log(2) ** k / math.factorial(k)) for k in range(8)]
_C1, _C2, _C3, _C4, _C5, _C6, _C7 = _C[1:]


@_jit(fastmath=True, inline="always")
def _exp(x):
    """e**x for x <= 0 (softmax arguments), flushed to 0 below -87."""
    if x < np.float32(-87.0):
        return np.float32(0.0)
    t = x * np.float32(1.4426950408889634)  # log2(e)
    n = np.floor(t)
    f = t - n
    p = np.float32(1.0) + f * (_C1 + f * (_C2 + f * (_C3 + f * (_C4 + f * (_C5 + f * (_C6 + f * _C7))))))
    return p * _i32_as_f32((np.int32(n) + np.int32(127)) << np.int32(23))


@_jit(fastmath=True, inline="always")
def _widen(src, dst):
    """bf16 bits -> float32, element by element (vectorized)."""
    for i in range(src.shape[0]):
        dst[i] = _bf16_to_f32(src[i])


@_jit(fastmath=True, inline="always")
def _softmax_row(s, i, n):
    """s[i, :n] (scores) -> exp(s - max) in place; returns 1 / their sum (the row's normalizer)."""
    m = s[i, 0]
    for t in range(1, n):
        m = max(m, s[i, t])
    total = np.float32(0.0)
    for t in range(n):
        e = _exp(s[i, t] - m)
        s[i, t] = e
        total += e
    return np.float32(1.0) / total


@functools.lru_cache(maxsize=None)
def _decode_kernel(dim: int, group: int):
    """The kernel for one head size and grouped-query ratio: both are compile-time constants inside
    (LLVM unrolls and vectorizes the head_dim loops; as runtime values the same code ran ~3x slower).
    Numba's disk cache keeps one entry per pair."""

    @_jit(fastmath=True)
    def kernel(q, k_pool, v_pool, page_index, ctx_lens, scale, out):
        rows, q_heads = q.shape[0], q.shape[1]
        page_size = k_pool.shape[1]
        width = k_pool.shape[2] * dim
        k_slots = k_pool.reshape(k_pool.shape[0] * page_size, width)  # [slot, kv_heads * head_dim]
        v_slots = v_pool.reshape(v_pool.shape[0] * page_size, width)
        longest = 1
        for b in range(rows):
            longest = max(longest, ctx_lens[b])
        s = np.empty((q_heads, longest), np.float32)
        slot = np.empty(longest, np.int64)
        qf = np.empty((q_heads, dim), np.float32)
        row = np.empty(width, np.float32)
        acc = np.empty((q_heads, dim), np.float32)
        for b in range(rows):
            n = ctx_lens[b]
            for h in range(q_heads):
                for d in range(dim):
                    qf[h, d] = _bf16_to_f32(q[b, h, d]) * scale
            for t in range(n):  # flat pool slot of each of the row's tokens
                slot[t] = page_index[b, t // page_size] * page_size + t % page_size
            for t in range(n):  # scores: every head against slot t, one K row (all KV heads) at a time
                _widen(k_slots[slot[t]], row)
                for h in range(q_heads):
                    base = (h // group) * dim
                    a = np.float32(0.0)
                    for d in range(dim):
                        a += qf[h, d] * row[base + d]
                    s[h, t] = a
            for h in range(q_heads):
                qf[h, 0] = _softmax_row(s, h, n)  # qf is free now: each head's normalizer
                for d in range(dim):
                    acc[h, d] = 0.0
            for t in range(n):  # weighted sum of V rows
                _widen(v_slots[slot[t]], row)
                for h in range(q_heads):
                    base = (h // group) * dim
                    p = s[h, t]
                    for d in range(dim):
                        acc[h, d] += p * row[base + d]
            for h in range(q_heads):
                inv = qf[h, 0]
                for d in range(dim):
                    out[b, h, d] = _round_bf16(acc[h, d] * inv)

    return kernel


@functools.lru_cache(maxsize=None)
def _decode_heads_kernel(dim: int, group: int):
    """`_decode_kernel` with a page table per (row, KV head): page_index [B, kv_heads, P], ctx_lens
    [B, kv_heads]. One KV head at a time: its `group` query heads against that head's slice of each slot."""

    @_jit(fastmath=True)
    def kernel(q, k_pool, v_pool, page_index, ctx_lens, scale, out):
        rows, kv_heads = page_index.shape[0], page_index.shape[1]
        page_size = k_pool.shape[1]
        longest = 1
        for b in range(rows):
            for g in range(kv_heads):
                longest = max(longest, ctx_lens[b, g])
        s = np.empty((group, longest), np.float32)
        qf = np.empty((group, dim), np.float32)
        row = np.empty(dim, np.float32)
        acc = np.empty((group, dim), np.float32)
        inv = np.empty(group, np.float32)
        for b in range(rows):
            for g in range(kv_heads):
                n = ctx_lens[b, g]
                for i in range(group):
                    for d in range(dim):
                        qf[i, d] = _bf16_to_f32(q[b, g * group + i, d]) * scale
                for t in range(n):  # scores: the group's heads against slot t of this KV head
                    _widen(k_pool[page_index[b, g, t // page_size], t % page_size, g], row)
                    for i in range(group):
                        a = np.float32(0.0)
                        for d in range(dim):
                            a += qf[i, d] * row[d]
                        s[i, t] = a
                for i in range(group):
                    inv[i] = _softmax_row(s, i, n)
                    for d in range(dim):
                        acc[i, d] = 0.0
                for t in range(n):  # weighted sum of this KV head's V rows
                    _widen(v_pool[page_index[b, g, t // page_size], t % page_size, g], row)
                    for i in range(group):
                        p = s[i, t]
                        for d in range(dim):
                            acc[i, d] += p * row[d]
                for i in range(group):
                    for d in range(dim):
                        out[b, g * group + i, d] = _round_bf16(acc[i, d] * inv[i])

    return kernel


def attend_decode_bf16(q_bits: np.ndarray, k_pool_bits: np.ndarray, v_pool_bits: np.ndarray,
                       page_index: np.ndarray, ctx_lens: np.ndarray, scale: float) -> np.ndarray:
    """Attention of one query per row over slots [0, ctx_lens[b]) of its pages (bf16 bits in and out; see
    the module map for shapes: one table per row, or per (row, KV head)). ValueError when a table attends
    no slot or more than its pages hold, or the shapes disagree (the kernels themselves check no bounds)."""
    rows, heads = q_bits.shape[:2]
    kv_heads = k_pool_bits.shape[2]
    per_head = page_index.ndim == 3
    want = (rows, kv_heads) if per_head else (rows,)
    if ctx_lens.shape != want or page_index.shape[:-1] != want:
        raise ValueError(f"{rows} query rows x {kv_heads} KV heads: page tables {page_index.shape[:-1]}, "
                         f"lengths {ctx_lens.shape}")
    if ctx_lens.size and (ctx_lens.min() < 1 or ctx_lens.max() > page_index.shape[-1] * k_pool_bits.shape[1]):
        raise ValueError(f"slot counts {ctx_lens.min()}..{ctx_lens.max()} outside [1, {page_index.shape[-1]} pages "
                         f"x {k_pool_bits.shape[1]} slots]")
    out = np.empty(q_bits.shape, np.uint16)
    lib = native_library()
    if lib is not None and rows >= NATIVE_MIN_ROWS and q_bits.shape[2] == 64 and k_pool_bits.flags.c_contiguous \
            and v_pool_bits.flags.c_contiguous:
        q_bits = np.ascontiguousarray(q_bits)
        page_index = np.ascontiguousarray(page_index, dtype=np.int64)
        ctx_lens = np.ascontiguousarray(ctx_lens, dtype=np.int64)
        work = _WORK.get(lib.pd_decode_work_bytes(int(ctx_lens.max()), heads))
        lib.pd_decode_attention_bf16(q_bits.ctypes.data, k_pool_bits.ctypes.data, v_pool_bits.ctypes.data,
                                     k_pool_bits.shape[1], page_index.ctypes.data, page_index.shape[-1],
                                     ctx_lens.ctypes.data, kv_heads if per_head else 1, rows, heads, kv_heads,
                                     float(scale), out.ctypes.data, work)
        return out
    make = _decode_heads_kernel if per_head else _decode_kernel
    kernel = make(q_bits.shape[2], heads // kv_heads)
    kernel(q_bits, k_pool_bits, v_pool_bits, page_index, ctx_lens, np.float32(scale), out)
    return out


def attend_decode_reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, page_index: torch.Tensor,
                            ctx_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """What `attend_decode_bf16` computes, in float64 torch, one (row, KV head) at a time: q [B, q_heads, D];
    pools [num_pages, page_size, kv_heads, D]; page_index [B, P] or [B, kv_heads, P]; ctx_lens [B] or
    [B, kv_heads] -> [B, q_heads, D] float64. Query head i reads KV head i // (q_heads // kv_heads)."""
    b, q_heads, d = q.shape
    ps, kv_heads = k_pool.shape[1], k_pool.shape[2]
    group = q_heads // kv_heads
    if page_index.dim() == 2:  # one table per row: the same table for every KV head
        page_index = page_index.unsqueeze(1).expand(b, kv_heads, page_index.shape[1])
        ctx_lens = ctx_lens.view(b, 1).expand(b, kv_heads)
    out = torch.empty(b, q_heads, d, dtype=torch.float64)
    for r in range(b):
        for g in range(kv_heads):
            n = int(ctx_lens[r, g])
            pages = page_index[r, g, :-(-n // ps)].long()
            k = k_pool[pages, :, g].reshape(-1, d)[:n].double()  # [n, D]
            v = v_pool[pages, :, g].reshape(-1, d)[:n].double()
            qs = q[r, g * group:(g + 1) * group].double()  # [group, D]
            out[r, g * group:(g + 1) * group] = ((qs @ k.T) * scale).softmax(-1) @ v
    return out


_WORK = cpu_native.Workspace()
# Rows from which the C kernel takes a decode group. Decode steps of SmolLM2 at context ~300, interleaved in
# one process (AMD EPYC, stop 20), C / numba: 1 row 21.52 / 20.95 and 20.95 / 20.43 ms, 4 rows 40.6 / 41.5 and
# 39.9 / 39.5, 16 rows 69.1 / 75.3 ms. Since the C kernel prefetches (one row, thread CPU time, medians of 6,
# C / numba): context 8,128 full 37.0 / 38.4 ms, sparse per KV head 25.0 / 29.3; context 2,048 full 24.7 / 25.5,
# sparse 24.4 / 28.0; context 304 full 18.4 / 18.2. So one row takes it too.
NATIVE_MIN_ROWS = 1


def native_library():
    """The C kernel of engine/kernels/cpu/csrc/decode_attention_bf16.c (AVX512-BF16, head_dim 64), or None."""
    return cpu_native.library("decode_attention_bf16")
