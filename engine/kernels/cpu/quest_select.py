"""Sparse attention's page choice on CPU in one compiled call per layer: Quest bounds, top-k and the paged
kernel's tables, for bf16 page summaries (C with AVX512-BF16 at head_dim 64: csrc/quest_select_bf16.c;
numba otherwise, the same contract).

Who calls it: `sparse.select` for bf16 summaries on CPU (the torch path beside it, `sparse.select(...,
kernel=False)`, is the reference the tests compare against). Per step `sparse._plan` makes the per-row
numbers (`row_numbers`); per layer `select_pages` runs the kernels and hands back a `sparse.Selection`
whose `lens` are the paged kernel's slot counts.

Why: the torch path spends ~10 tensor ops per layer on a [rows, pages, kv_heads] score tensor (masks, topk,
sort, gathers) besides the bounds. Measured at 8 rows x 8k context, 30 layers (thread CPU time, shared
machine): numba bounds + torch top-k 20-32 ms a step in the engine; this module's numba kernel ~42 ms
(its bounds' horizontal sums); the C kernel ~11 ms, about the summaries' read (1/16 of the KV).

What it computes, per row b with n pages (the torch path's result, ties aside):
  - s_row >= n (short rows, rows with no config or below min_context): every page;
  - else the forced pages (the first `sinks`, and from `first_recent` on: the recent window) and, among
    the pages between, the k = s_row - forced best by Quest's bound (q+ . max + q- . min per query head;
    a KV head's query heads reduced by max, or sum where `gqa_sum`), one choice per KV head, or one per
    row from the bounds summed over KV heads (`row_mode`). Ties at the k-th score go to the earlier page.
  Out: pages [B, kv_heads, S] in page order, padded with page 0; slots [B, kv_heads, S] filled slots of
  each (page_size, the row's `tail` for its last page, 0 for padding); lens [B, kv_heads] their sums.
No inf or nan arithmetic (fastmath): forced pages are taken by position, not by an infinite score, and
only a row's own pages (all filled) are scored.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from engine.kernels.cpu import native as cpu_native
from engine.kernels.cpu.numba_kernels import _bf16_to_f32, _jit, bits


@_jit()
def _kth_largest(vals, m, k):
    """The k-th largest of vals[0:m] (1 <= k <= m), by quickselect; reorders vals[0:m]."""
    lo, hi, target = 0, m - 1, k - 1
    while lo < hi:
        pivot = vals[(lo + hi) // 2]
        i, j = lo, hi
        while i <= j:  # Hoare partition, larger values first
            while vals[i] > pivot:
                i += 1
            while vals[j] < pivot:
                j -= 1
            if i <= j:
                vals[i], vals[j] = vals[j], vals[i]
                i += 1
                j -= 1
        if target <= j:
            hi = j
        elif target >= i:
            lo = i
        else:
            break
    return vals[target]


def row_numbers(n_pages: list[int], s_row: list[int], sinks: list[int], first_recent: list[int], tail: list[int],
                row_mode: list[bool], gqa_sum: list[bool]) -> dict:
    """The per-row numbers of a step (`sparse._plan` calls this once per step) as the kernels' arrays: the
    pages scored, [first, stop) (the rest of the row is forced in: sinks and recent window), and how many
    of them are chosen by score (`by_score`; every scored page where the budget covers them, and none
    scored at all for rows that read every page)."""
    first, stop, by_score = [], [], []
    for n, s, sk, fr in zip(n_pages, s_row, sinks, first_recent):
        a = min(sk, n)
        z = max(fr, a)
        k = max(0, s - a - (n - z))
        if s >= n or k >= z - a:  # every page: nothing to score
            a, z, k = 0, 0, 0
        first.append(a)
        stop.append(z)
        by_score.append(k)
    i64 = functools.partial(np.array, dtype=np.int64)
    return {"n_pages": i64(n_pages), "s_row": i64(s_row), "first": i64(first), "stop": i64(stop),
            "by_score": i64(by_score), "tail": i64(tail), "row_mode": np.array(row_mode, np.uint8),
            "gqa_sum": np.array(gqa_sum, np.uint8)}


@functools.lru_cache(maxsize=None)
def _select_kernel(dim: int, group: int):
    """The kernel for one head size and grouped-query ratio (compile-time constants, as the paged
    attention kernel's: LLVM vectorizes the head_dim loops); the C kernel's contract (quest_select_bf16.c)."""

    @_jit(fastmath=True)
    def kernel(q, lo, hi, page_index, r_pages, r_first, r_stop, r_k, r_tail, gqa_sum, row_mode, page_size,
               out_pages, out_slots, out_lens):
        rows, kv_heads, width = page_index.shape[0], lo.shape[1], out_pages.shape[2]
        qp = np.empty((group, dim), np.float32)
        qn = np.empty((group, dim), np.float32)
        lrow = np.empty(dim, np.float32)
        hrow = np.empty(dim, np.float32)
        work = np.empty(page_index.shape[1], np.float32)
        chosen = np.empty(page_index.shape[1] + 1, np.int64)
        score = np.empty((kv_heads + 1, page_index.shape[1]), np.float32)
        for b in range(rows):
            n, a, z, k = r_pages[b], r_first[b], r_stop[b], r_k[b]
            sb = score  # [kv_heads + 1, P]: this row's
            if z > a:
                for h in range(kv_heads):
                    for g in range(group):
                        for d in range(dim):
                            x = _bf16_to_f32(q[b, h * group + g, d])
                            qp[g, d] = max(x, np.float32(0.0))
                            qn[g, d] = min(x, np.float32(0.0))
                    for j in range(a, z):
                        p = page_index[b, j]
                        for d in range(dim):
                            lrow[d] = _bf16_to_f32(lo[p, h, d])
                            hrow[d] = _bf16_to_f32(hi[p, h, d])
                        best = np.float32(0.0)
                        for g in range(group):
                            acc = np.float32(0.0)
                            for d in range(dim):
                                acc += qp[g, d] * hrow[d] + qn[g, d] * lrow[d]
                            if gqa_sum[b]:
                                best += acc
                            elif g == 0 or acc > best:
                                best = acc
                        sb[h, j] = best
                if row_mode[b]:  # one choice for every KV head: the bounds summed over them
                    for j in range(a, z):
                        t = np.float32(0.0)
                        for h in range(kv_heads):
                            t += sb[h, j]
                        sb[kv_heads, j] = t
            for h in range(kv_heads):
                src = kv_heads if row_mode[b] else h
                m = 0  # positions j of the chosen pages, in page order, into `chosen`
                for j in range(a):  # sinks
                    chosen[m] = j
                    m += 1
                if z > a:  # the k best of [a, z): above the k-th best score, then ties at it in page order
                    for j in range(a, z):
                        work[j - a] = sb[src, j]
                    thr = _kth_largest(work, z - a, k)
                    ties = k
                    for j in range(a, z):
                        ties -= np.int64(sb[src, j] > thr)
                    if ties == 0:
                        for j in range(a, z):  # branch-free: always written, kept when taken
                            chosen[m] = j
                            m += np.int64(sb[src, j] > thr)
                    else:
                        for j in range(a, z):
                            sc = sb[src, j]
                            if sc > thr or (sc == thr and ties > 0):
                                ties -= np.int64(sc == thr)
                                chosen[m] = j
                                m += 1
                for j in range(z if z > a else a, n):  # the recent window (every page where nothing is scored)
                    chosen[m] = j
                    m += 1
                m = min(m, width)
                for i in range(m):
                    out_pages[b, h, i] = page_index[b, chosen[i]]
                    out_slots[b, h, i] = page_size
                total = m * page_size
                if m > 0 and chosen[m - 1] == n - 1:  # the row's last page: partly filled
                    out_slots[b, h, m - 1] = r_tail[b]
                    total += r_tail[b] - page_size
                for i in range(m, width):
                    out_pages[b, h, i] = 0
                    out_slots[b, h, i] = 0
                out_lens[b, h] = total

    return kernel


_ROW_KEYS = ("n_pages", "first", "stop", "by_score", "tail", "gqa_sum", "row_mode")  # the kernels' argument order
_WORK = cpu_native.Workspace()


def native_library():
    """The C choice of csrc/quest_select_bf16.c (AVX512-BF16, head_dim 64), or None."""
    return cpu_native.library("quest_select_bf16")


def select_pages(rows_np: dict, width: int, lo: torch.Tensor, hi: torch.Tensor, q: torch.Tensor,
                 page_index: torch.Tensor, page_size: int):
    """One layer's choice (see the module map): lo/hi [num_pages, kv_heads, D] bf16; q [B, q_heads, D] bf16;
    page_index [B, P]; rows_np: `row_numbers(...)`; width: S, the most pages a row reads.
    -> (pages, slots) [B, kv_heads, S] int64 tensors and lens [B, kv_heads] int64 numpy."""
    b, kv_heads, dim = page_index.shape[0], lo.shape[1], q.shape[-1]
    group = q.shape[1] // kv_heads
    pages = torch.empty((b, kv_heads, width), dtype=torch.int64)
    slots = torch.empty((b, kv_heads, width), dtype=torch.int64)
    lens = np.empty((b, kv_heads), np.int64)
    table = page_index.to(torch.int64).contiguous()
    lib = native_library()
    if lib is not None and dim == 64 and group <= 16:  # bounds and choice in C (csrc/quest_select_bf16.c)
        # Raw addresses (torch's data_ptr: ~0.1 us; numpy's .ctypes.data ~1.5 us each, 13 of them per layer)
        q, lo, hi = q.contiguous(), lo.contiguous(), hi.contiguous()
        if "ptrs" not in rows_np:  # the per-row arrays live as long as the step's plan
            rows_np["ptrs"] = tuple(rows_np[k].ctypes.data for k in _ROW_KEYS)
        work = _WORK.get(lib.pd_quest_select_work_bytes(table.shape[1], kv_heads))
        lib.pd_quest_select_bf16(q.data_ptr(), lo.data_ptr(), hi.data_ptr(), table.data_ptr(), table.shape[1], b,
                                 q.shape[1], kv_heads, *rows_np["ptrs"], page_size, width, pages.data_ptr(),
                                 slots.data_ptr(), lens.ctypes.data, work)
    else:
        _select_kernel(dim, group)(bits(q), bits(lo), bits(hi), table.numpy(), *(rows_np[k] for k in _ROW_KEYS),
                                   page_size, pages.numpy(), slots.numpy(), lens)
    return pages, slots, lens
