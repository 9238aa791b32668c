"""Sparse attention's page choice on CPU in one compiled call per layer: Quest bounds, top-k and the paged
kernel's tables, for bf16 page summaries (numba).

Who calls it: `sparse.select` for bf16 summaries on CPU (the torch path beside it, `sparse.select(...,
kernel=False)`, is the reference the tests compare against). Per step `sparse._plan` makes the per-row
numbers (`rows_np`); per layer `select_pages` runs the kernel and hands back a `sparse.Selection` whose
`lens` are the paged kernel's slot counts.

Why: the torch path spends ~10 tensor ops per layer on a [rows, pages, kv_heads] score tensor (masks, topk,
sort, gathers), ~0.2-0.3 ms a layer at 8 rows x 8k context, about as much as reading the chosen pages;
here the same choice costs the bounds (the summaries read once) plus a quickselect per (row, KV head).

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

from engine.cpu_kernels import _bf16_to_f32, _jit, bits


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


@functools.lru_cache(maxsize=None)
def _select_kernel(dim: int, group: int):
    """The kernel for one head size and grouped-query ratio (compile-time constants, as the paged
    attention kernel's: LLVM vectorizes the head_dim loops)."""

    @_jit(fastmath=True)
    def kernel(q, lo, hi, page_index, n_pages, s_row, sinks, first_recent, tail, row_mode, gqa_sum, page_size,
               out_pages, out_slots, out_lens):
        rows, kv_heads, width = page_index.shape[0], lo.shape[1], out_pages.shape[2]
        qp = np.empty((group, dim), np.float32)
        qn = np.empty((group, dim), np.float32)
        lrow = np.empty(dim, np.float32)
        hrow = np.empty(dim, np.float32)
        score = np.zeros((kv_heads + 1, page_index.shape[1]), np.float32)  # [KV head or row sum, page]
        work = np.empty(page_index.shape[1], np.float32)
        for b in range(rows):
            n = n_pages[b]
            for h in range(kv_heads):
                for i in range(width):
                    out_pages[b, h, i] = 0
                    out_slots[b, h, i] = 0
            a, z = min(sinks[b], n), max(first_recent[b], min(sinks[b], n))  # scored: pages [a, z)
            k = s_row[b] - a - (n - z)  # pages chosen by score
            if s_row[b] >= n:
                a, z, k = n, n, 0  # every page (all taken as "forced")
            if k > 0 and k < z - a:
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
                        score[h, j] = best
                if row_mode[b]:  # one choice for every KV head: the bounds summed over them
                    for j in range(a, z):
                        t = np.float32(0.0)
                        for h in range(kv_heads):
                            t += score[h, j]
                        score[kv_heads, j] = t
            elif k > 0:
                k = z - a  # the budget covers every scored page
            for h in range(kv_heads):
                src = kv_heads if row_mode[b] else h
                thr = np.float32(0.0)
                above = 0
                if 0 < k < z - a:
                    for j in range(a, z):
                        work[j - a] = score[src, j]
                    thr = _kth_largest(work, z - a, k)
                    for j in range(a, z):
                        if score[src, j] > thr:
                            above += 1
                ties = k - above  # pages scoring exactly the k-th score, taken in page order
                i, total = 0, 0
                for j in range(n):
                    take = j < a or j >= z or k >= z - a
                    if not take and k > 0:
                        sc = score[src, j]
                        if sc > thr:
                            take = True
                        elif sc == thr and ties > 0:
                            take = True
                            ties -= 1
                    if take and i < width:
                        filled = tail[b] if j == n - 1 else page_size
                        out_pages[b, h, i] = page_index[b, j]
                        out_slots[b, h, i] = filled
                        total += filled
                        i += 1
                out_lens[b, h] = total

    return kernel


def select_pages(rows_np: dict, width: int, lo: torch.Tensor, hi: torch.Tensor, q: torch.Tensor,
                 page_index: torch.Tensor, page_size: int):
    """One layer's choice (see the module map): lo/hi [num_pages, kv_heads, D] bf16; q [B, q_heads, D] bf16;
    page_index [B, P]; rows_np: `sparse._plan`'s per-row arrays; width: S, the most pages a row reads.
    -> (pages, slots) [B, kv_heads, S] int64 tensors and lens [B, kv_heads] int64 numpy."""
    b, kv_heads = page_index.shape[0], lo.shape[1]
    pages = np.empty((b, kv_heads, width), np.int64)
    slots = np.empty((b, kv_heads, width), np.int64)
    lens = np.empty((b, kv_heads), np.int64)
    kernel = _select_kernel(q.shape[-1], q.shape[1] // kv_heads)
    r = rows_np
    kernel(bits(q), bits(lo), bits(hi), page_index.numpy(), r["n_pages"], r["s_row"], r["sinks"], r["first_recent"],
           r["tail"], r["row_mode"], r["gqa_sum"], page_size, pages, slots, lens)
    return torch.from_numpy(pages), torch.from_numpy(slots), lens
