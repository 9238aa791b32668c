"""Paged attention of several queries per sequence (prefill chunks, verify steps) for bfloat16 on CPU, by
the AVX512-BF16 kernel of `engine/kernels/cpu/csrc/attention_bf16.c` (built by `engine.kernels.cpu.native`).

Why: torch's CPU flash attention (what SDPA runs) reaches ~35 GFLOP/s on a core without AMX, ~30% of a
512-token prefill step of SmolLM2 on the development machine (AMD EPYC, one thread); the kernel reads K/V
straight from the pages (no gather) and does its dot products with vdpbf16ps. Measured there
(`bench/engine/attention_bench.py`, a layer, SmolLM2's heads): 512-token causal prompt 2.3 vs 8.6 ms, a 128-token
chunk after 384 cached slots 1.0 vs 2.4 ms, a 4-token verify step after 300 0.10 vs 0.14 ms.

    prefill_attention_bf16(q, k_pool, v_pool, page_index, ctx_lens, q_len, scale) -> out
    # q [rows * q_len, heads, dim] bf16 (token stride free, heads and dims contiguous); pools [num_pages,
    # page_size, kv_heads, dim] bf16; page_index [rows, >= pages] int64; ctx_lens [rows] int64 numpy
    # (row b's query i sees slots [0, ctx_lens[b] - q_len + i]); out [rows * q_len, heads, dim] bf16

Math (as torch's flash kernel for bf16): scores and softmax in float32, probabilities rounded to bf16 for
the weighted sum, which sums in float32; the output rounded once to bf16. `available()` says whether the
kernel runs here (compiler, CPU with AVX512-BF16, PDSERVE_NATIVE not 0); `RawKVBackend` asks before use.
"""
from __future__ import annotations

import numpy as np
import torch

from engine.kernels.cpu import native as cpu_native

_LIB = "attention_bf16"


def _lib():
    return cpu_native.library(_LIB)


def available() -> bool:
    """The kernel runs here. Not on CPUs with AMX: there torch's flash attention runs its GEMMs on AMX tiles,
    and this kernel, measured only on a CPU without them, may well be the slower path (unmeasured)."""
    return "amx_bf16" not in cpu_native.cpu_flags() and _lib() is not None


def supports(head_dim: int, heads: int, kv_heads: int) -> bool:
    """Shapes the kernel handles: head_dim a multiple of 64, query heads a multiple of the KV heads."""
    return head_dim % 64 == 0 and heads % kv_heads == 0


_WORK = cpu_native.Workspace()


def prefill_attention_bf16(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           page_index: np.ndarray, ctx_lens: np.ndarray, q_len: int,
                           scale: float) -> torch.Tensor:
    """See the module map. ValueError for shapes, dtypes or slot counts the kernel cannot take (it does
    not check bounds itself)."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("the native prefill attention kernel is not available here (see available())")
    tokens, heads, dim = q.shape
    num_pages, page_size, kv_heads, kdim = k_pool.shape
    rows = ctx_lens.shape[0]
    if q.dtype != torch.bfloat16 or k_pool.dtype != torch.bfloat16 or v_pool.dtype != torch.bfloat16:
        raise ValueError(f"bf16 only, got q {q.dtype}, pools {k_pool.dtype}/{v_pool.dtype}")
    if kdim != dim or v_pool.shape != k_pool.shape or not supports(dim, heads, kv_heads):
        raise ValueError(f"shapes q {tuple(q.shape)}, pools {tuple(k_pool.shape)}/{tuple(v_pool.shape)} unsupported")
    if q.stride(2) != 1 or q.stride(1) != dim or not (k_pool.is_contiguous() and v_pool.is_contiguous()):
        raise ValueError("q needs contiguous heads and dims, the pools must be contiguous")
    if tokens != rows * q_len or q_len < 1 or page_index.shape[0] != rows or page_index.dtype != np.int64:
        raise ValueError(f"{tokens} query tokens for {rows} rows x {q_len}, page table {page_index.shape}")
    ctx_lens = np.ascontiguousarray(ctx_lens, dtype=np.int64)
    page_index = np.ascontiguousarray(page_index)
    if rows and (ctx_lens.min() < q_len or ctx_lens.max() > page_index.shape[1] * page_size):
        raise ValueError(f"slot counts {ctx_lens.min()}..{ctx_lens.max()} outside [{q_len}, "
                         f"{page_index.shape[1]} pages x {page_size} slots]")
    if rows and page_index.size and (page_index.min() < 0 or page_index.max() >= num_pages):
        raise ValueError(f"page ids outside [0, {num_pages})")
    out = torch.empty((tokens, heads, dim), dtype=torch.bfloat16)
    if rows == 0:
        return out
    work = _WORK.get(lib.pd_prefill_work_bytes(int(ctx_lens.max()), kv_heads, dim))
    lib.pd_prefill_attention_bf16(q.data_ptr(), q.stride(0), k_pool.data_ptr(), v_pool.data_ptr(), page_size,
                                  page_index.ctypes.data, page_index.shape[1], ctx_lens.ctypes.data, rows,
                                  q_len, heads, kv_heads, dim, float(scale), out.data_ptr(), work)
    return out
