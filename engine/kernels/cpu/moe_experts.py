"""A whole bfloat16 mixture-of-experts step on CPU in one numba call: the (token, expert) assignments grouped
by expert, each active expert's SwiGLU over all of its rows (its weights read once), the outputs weighted
and summed into each token's row in ascending expert order. `engine.moe.grouped` calls it for bf16 on CPU.

Why: at tiny widths (hidden 256, experts of 128) the grouped path in torch spent ~100 us per active expert
on op dispatch (a oneDNN call for gate_up and one for down at ~55 us each for 4 rows, the SwiGLU, views) and
~120 us a step on argsort / bincount / gather / mul / index_add_, more than reading the expert's 196 kB of
weights costs; here the per-expert cost is the weight read and the FLOPs.

    moe_experts_bf16(h, ids, weights, first_expert, gate_up, down) -> out      # torch tensors, bf16 on CPU
    moe_experts_reference(...)                                                 # the same in plain torch

Rounding, as the torch path (and transformers' bf16 block) rounds: gate_up and down each accumulated in
float32 and rounded once to bf16 (as `Linear`: oneDNN or the GEMV; the sum's order differs, so a last bf16
bit differs now and then); silu(gate) rounded to bf16, then times up rounded; y * weight rounded to bf16;
the token's sum rounded to bf16 after each expert's add (torch's bf16 `index_add_`).
ids [tokens, top_k] are global expert ids; only those in [first_expert, first_expert + gate_up.shape[0]) are
computed (an expert-parallel rank's partial sum; zero rows for tokens none of its experts took).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from engine.kernels.cpu.numba_kernels import _bf16_to_f32, _jit, _round_bf16, bits

# rows x an expert's weight elements up to which the kernel computes the expert; above, its rows go to `expert`
# (oneDNN's blocked GEMM / the GEMV). Measured (one thread, bf16): hidden 256, experts of 128 (98k elements)
# at 16 rows 0.63 ms vs 1.29 ms a layer of 8 experts, at 64 rows 2.6 vs 1.7 ms; hidden 2048, experts of 768
# (4.7M) the kernel lost even at one row (1.4 vs 1.1 ms): its dot products are not a blocked GEMM.
MAX_WORK = 2 ** 21
ROW_BLOCK = 4  # rows sharing one pass over a weight row (its loads reused from registers)


@_jit(fastmath={"reassoc", "nsz", "contract"})  # reordered sums; exact exp / division for silu
def _dots(w, xf, n, out, o):
    """out[r, o] = bf16-rounded (w . xf[r]) for r < n: w [n_in] bf16 bits, xf [rows, n_in] float32."""
    n_in = w.shape[0]
    r = 0
    while r + ROW_BLOCK <= n:
        a0 = a1 = a2 = a3 = np.float32(0.0)
        for i in range(n_in):
            wi = _bf16_to_f32(w[i])
            a0 += wi * xf[r, i]
            a1 += wi * xf[r + 1, i]
            a2 += wi * xf[r + 2, i]
            a3 += wi * xf[r + 3, i]
        out[r, o] = _bf16_to_f32(_round_bf16(a0))
        out[r + 1, o] = _bf16_to_f32(_round_bf16(a1))
        out[r + 2, o] = _bf16_to_f32(_round_bf16(a2))
        out[r + 3, o] = _bf16_to_f32(_round_bf16(a3))
        r += ROW_BLOCK
    while r < n:
        acc = np.float32(0.0)
        for i in range(n_in):
            acc += _bf16_to_f32(w[i]) * xf[r, i]
        out[r, o] = _bf16_to_f32(_round_bf16(acc))
        r += 1


@_jit()
def _sort(ids, ws, first, held):
    """Counting sort of the assignments to held experts by local id -> (starts [held + 1], token of each
    sorted assignment (ascending within an expert) [A], its weight [A] float32)."""
    tokens, k = ids.shape
    starts = np.zeros(held + 1, np.int64)
    for t in range(tokens):
        for j in range(k):
            e = ids[t, j] - first
            if 0 <= e < held:
                starts[e + 1] += 1
    for e in range(held):
        starts[e + 1] += starts[e]
    fill = starts[:held].copy()
    rows = np.empty(starts[held], np.int64)
    rw = np.empty(starts[held], np.float32)
    for t in range(tokens):
        for j in range(k):
            e = ids[t, j] - first
            if 0 <= e < held:
                rows[fill[e]] = t
                rw[fill[e]] = ws[t, j]
                fill[e] += 1
    return starts, rows, rw


@_jit(fastmath={"reassoc", "nsz", "contract"})
def _moe_kernel(x, starts, rows, rw, max_rows, ys, gate_up, down, out):
    """x [tokens, hidden], gate_up [E, 2I, hidden], down [E, hidden, I], out [tokens, hidden] (zeros): bf16
    bits; experts with more than `max_rows` rows come computed in ys [their rows, hidden] (bf16 bits, side by
    side in ascending expert order)."""
    held, inter2, hidden = gate_up.shape
    inter = inter2 // 2
    most = 0
    for e in range(held):
        n = starts[e + 1] - starts[e]
        if n <= max_rows:
            most = max(most, n)
    xf = np.empty((most, hidden), np.float32)
    gu = np.empty((most, inter2), np.float32)
    act = np.empty((most, inter), np.float32)
    y = np.empty((most, hidden), np.float32)
    b = 0  # the next expert's first row in ys
    for e in range(held):  # ascending: each token's sum in transformers' order
        s, n = starts[e], starts[e + 1] - starts[e]
        if n == 0:
            continue
        if n <= max_rows:
            for r in range(n):
                for i in range(hidden):
                    xf[r, i] = _bf16_to_f32(x[rows[s + r], i])
            for o in range(inter2):
                _dots(gate_up[e, o], xf, n, gu, o)
            for r in range(n):
                for i in range(inter):
                    g = gu[r, i]
                    silu = _bf16_to_f32(_round_bf16(g / (np.float32(1.0) + np.exp(-g))))
                    act[r, i] = _bf16_to_f32(_round_bf16(silu * gu[r, inter + i]))
            for o in range(hidden):
                _dots(down[e, o], act, n, y, o)
        for r in range(n):
            if n <= max_rows:
                _add_weighted(y[r], rw[s + r], out[rows[s + r]])
            else:
                _add_weighted_bits(ys[b + r], rw[s + r], out[rows[s + r]])
        if n > max_rows:
            b += n


@_jit(fastmath={"reassoc", "nsz", "contract"})
def _add_weighted(y, w, out):
    """out (bf16 bits) = bf16(out + bf16(y * w)), y float32: torch's bf16 mul, then its bf16 index_add_."""
    for o in range(y.shape[0]):
        out[o] = _round_bf16(_bf16_to_f32(out[o]) + _bf16_to_f32(_round_bf16(y[o] * w)))


@_jit(fastmath={"reassoc", "nsz", "contract"})
def _add_weighted_bits(y, w, out):
    """`_add_weighted` for y given as bf16 bits."""
    for o in range(y.shape[0]):
        out[o] = _round_bf16(_bf16_to_f32(out[o]) + _bf16_to_f32(_round_bf16(_bf16_to_f32(y[o]) * w)))


def kernel_rows(gate_up: torch.Tensor, down: torch.Tensor, max_work: int = MAX_WORK) -> int:
    """An expert's rows up to which the kernel computes it (0: never, wide experts: `engine.moe` then keeps
    its torch path)."""
    return max_work // (gate_up[0].numel() + down[0].numel())


def moe_experts_bf16(h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, first_expert: int,
                     gate_up: torch.Tensor, down: torch.Tensor,
                     expert: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
                     max_work: int = MAX_WORK) -> torch.Tensor:
    """h [tokens, hidden] bf16, ids / weights [tokens, top_k] (router's), gate_up [E, 2I, hidden], down [E,
    hidden, I] bf16 (the experts held from `first_expert` on) -> [tokens, hidden] bf16. An expert with more
    than `max_work` / its weight elements rows runs `expert(local id, rows [n, hidden]) -> [n, hidden]` (bf16)
    instead."""
    held, hidden = gate_up.shape[0], h.shape[1]
    max_rows = kernel_rows(gate_up, down, max_work)
    starts, rows, rw = _sort(ids.contiguous().numpy(), weights.float().contiguous().numpy(), first_expert, held)
    big = np.flatnonzero(np.diff(starts) > max_rows).tolist()
    ys = torch.empty((0, hidden), dtype=torch.bfloat16)
    if big:  # many rows: a blocked GEMM (oneDNN) beats this kernel's dot products
        xs = h.index_select(0, torch.from_numpy(rows))  # one gather for all (a gather per expert cost ~13 us)
        run = expert or _expert_reference(gate_up, down)
        ys = torch.cat([run(e, xs[starts[e]:starts[e + 1]]) for e in big])
    out = torch.zeros_like(h)
    _moe_kernel(bits(h), starts, rows, rw, max_rows, bits(ys), bits(gate_up), bits(down), bits(out))
    return out


def _expert_reference(gate_up: torch.Tensor, down: torch.Tensor) -> Callable[[int, torch.Tensor], torch.Tensor]:
    def run(e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, gate_up[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, down[e])
    return run


def moe_experts_reference(h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, first_expert: int,
                          gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The kernel's plain torch reference: expert by expert in ascending order, bf16 ops as transformers'."""
    out = torch.zeros_like(h)
    for e in range(gate_up.shape[0]):
        tok, slot = (ids == first_expert + e).nonzero(as_tuple=True)  # tokens ascending
        if tok.numel():
            y = _expert_reference(gate_up, down)(e, h[tok])
            out.index_add_(0, tok, (y * weights[tok, slot][:, None]).to(h.dtype))
    return out
