"""CPU kernels compiled with numba: bfloat16 matrix-vector products for small-batch decode, and RMSNorm.

Why: a decode step at batch 1 is a chain of matrix-vector products whose cost is reading the weights.
Measured on the development machine (one thread, SmolLM2-135M's 269 MB of bf16 weights, interleaved in
one run): oneDNN's prepacked GEMV and torch's `F.linear` both ~67-71 ms, this kernel ~41 ms (a plain
sum over a float32 tensor reads ~9 GB/s there). At 16 rows oneDNN's blocked GEMM is faster, so `Linear`
uses this only for a few rows (`MAX_ROWS`).

    y = gemv_bf16(weight_bits, x_bits, bias_bits, residual_bits)   # uint16 arrays of bfloat16 bits
    y = rms_norm_bf16(x_bits, weight_bits, eps)

RMSNorm: torch's fused `F.rms_norm` runs ~8 ops per call in bf16 (~37 us at 1 row, ~51 at 16, ~2.1 ms at
512 rows on that machine; this kernel ~21 / ~28 / ~0.32 ms), and its bf16 results differ from Hugging
Face's in ~25% of elements; this kernel rounds where Hugging Face does (bit-equal in the test).

Math: every product and sum in float32 (fastmath lets LLVM vectorize and reorder the sum), the result
rounded once to bfloat16 (round to nearest even, NaN kept NaN) -- after adding the bias and the residual
when given, as oneDNN's fused add does. Numbers differ from oneDNN's in the last bf16 bit now and then
(another summation order); float32 models never come here (their logits must match transformers' bit
for bit, and `F.linear` / `F.rms_norm` give that).
Compiled on first use and cached on disk (numba's `cache=True`: next to this file, or the user cache
directory when that is read-only), so a worker process pays the compile once per machine; where no cache
location is writable at all, each process compiles (~1.5 s) rather than failing at import (`_jit`).
"""
from __future__ import annotations

import numpy as np
import torch
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

MAX_ROWS = 2  # rows (tokens) up to which Linear takes this path; above it oneDNN's GEMM wins


def _jit(**options):
    """`njit(cache=True, nogil=True, boundscheck=False, **options)`; without the disk cache when numba
    finds no writable place for it (it raises RuntimeError when the function is decorated)."""
    def decorate(fn):
        try:
            return njit(cache=True, nogil=True, boundscheck=False, **options)(fn)
        except RuntimeError:
            return njit(nogil=True, boundscheck=False, **options)(fn)
    return decorate


@intrinsic
def _bf16_to_f32(typingctx, bits):
    """bfloat16 bits (uint16) -> float32: the bits are the float32's upper half."""
    def codegen(context, builder, signature, args):
        wide = builder.zext(args[0], ir.IntType(32))
        return builder.bitcast(builder.shl(wide, ir.Constant(ir.IntType(32), 16)), ir.FloatType())
    return types.float32(types.uint16), codegen


@intrinsic
def _f32_bits(typingctx, value):
    """float32 -> its bits (uint32)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@_jit()
def _round_bf16(value):
    bits = _f32_bits(value)
    if (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):  # NaN stays a (quiet) NaN
        return np.uint16(0x7FC0)
    bits += np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return np.uint16(bits >> np.uint32(16))


@_jit(fastmath=True)
def _gemv_kernel(w, x, bias, residual, out):
    """w [n_out, n_in], x [rows, n_in], bias [n_out] or [0], residual [rows, n_out] or [0, 0], out [rows,
    n_out]: bf16 bits."""
    n_out, n_in = w.shape
    rows = x.shape[0]
    xf = np.empty((rows, n_in), np.float32)
    for r in range(rows):
        for i in range(n_in):
            xf[r, i] = _bf16_to_f32(x[r, i])
    add, biased = residual.shape[0] > 0, bias.shape[0] > 0
    for o in range(n_out):
        for r in range(rows):
            acc = np.float32(0.0)
            for i in range(n_in):
                acc += _bf16_to_f32(w[o, i]) * xf[r, i]
            if biased:
                acc += _bf16_to_f32(bias[o])
            if add:
                acc += _bf16_to_f32(residual[r, o])
            out[r, o] = _round_bf16(acc)


@_jit(fastmath={"reassoc", "nsz", "contract"})  # no approximate 1/sqrt: the scale is what torch computes
def _rms_norm_kernel(x, w, eps, out):
    """x [rows, n], w [n], out [rows, n]: bf16 bits. Hugging Face's order of roundings: the normalized
    row in float32 rounded to bf16, then times the weight, rounded again."""
    rows, n = x.shape
    for r in range(rows):
        ss = np.float32(0.0)
        for i in range(n):
            v = _bf16_to_f32(x[r, i])
            ss += v * v
        scale = np.float32(1.0) / np.sqrt(ss / np.float32(n) + eps)
        for i in range(n):
            h = _bf16_to_f32(_round_bf16(_bf16_to_f32(x[r, i]) * scale))
            out[r, i] = _round_bf16(_bf16_to_f32(w[i]) * h)


_NO_BIAS, _NO_RESIDUAL = np.empty(0, np.uint16), np.empty((0, 0), np.uint16)


def gemv_bf16(weight_bits: np.ndarray, x_bits: np.ndarray, bias_bits: np.ndarray | None = None,
              residual_bits: np.ndarray | None = None) -> np.ndarray:
    """weight [n_out, n_in], x [rows, n_in], bias [n_out], residual [rows, n_out] (uint16 bf16 bits,
    C-contiguous) -> x @ weight.T (+ bias) (+ residual) as bf16 bits [rows, n_out]."""
    out = np.empty((x_bits.shape[0], weight_bits.shape[0]), np.uint16)
    _gemv_kernel(weight_bits, x_bits, _NO_BIAS if bias_bits is None else bias_bits,
                 _NO_RESIDUAL if residual_bits is None else residual_bits, out)
    return out


def rms_norm_bf16(x_bits: np.ndarray, weight_bits: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm of each row of x [rows, n] with weight [n] (bf16 bits) -> bf16 bits [rows, n]."""
    out = np.empty(x_bits.shape, np.uint16)
    _rms_norm_kernel(x_bits, weight_bits, np.float32(eps), out)
    return out


def bits(t: torch.Tensor) -> np.ndarray:
    """A bf16 CPU tensor's bits as a uint16 numpy array (a view when it is contiguous)."""
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def from_bits(a: np.ndarray) -> torch.Tensor:
    """uint16 bf16 bits -> a bf16 tensor sharing their memory."""
    return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
