"""Fused Triton kernels for the CUDA forward's small ops (engine/kernels/cuda/fused_forward.py calls them).

Why: at decode, a layer's GEMMs read the weights once; everything else is launch count. Torch ran ~18
kernels a layer (RoPE alone four, the K/V write two, each residual add and norm one); these bring it to ~10.
  - `rope_write`: RoPE on the q and k heads of a fused qkv row, rotated K and V stored at the token's slot in
    the page pool, rotated q returned (one program per token).
  - `add_rms_norm`: x + delta (rounded to x's dtype, as torch's add) -> the new residual, and its RMSNorm
    times the weight (one program per row).
  - `silu_mul`: silu(gate) * up over a fused [gate | up] row (one program per row block).
References in torch: engine/kernels/reference.py; tests on CPU under Triton's interpreter.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_write_kernel(QKV, COS, SIN, KP, VP, SLOTS, QOUT, s_qkv, s_cos, s_kslot, s_vslot, s_qo,
                       HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, H_PAD: tl.constexpr):
    t = tl.program_id(0)
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D)
    half: tl.constexpr = D // 2
    rolled = (d + half) % D  # torch's x.roll(D/2)[d] reads x[d - D/2], the same index mod D
    row = QKV + t.to(tl.int64) * s_qkv
    cos = tl.load(COS + t.to(tl.int64) * s_cos + d).to(tl.float32)
    sin = tl.load(SIN + t.to(tl.int64) * s_cos + d).to(tl.float32)
    qk_ok = h < HQ + HKV
    off = h[:, None] * D
    x = tl.load(row + off + d[None, :], mask=qk_ok[:, None], other=0.0).to(tl.float32)
    xr = tl.load(row + off + rolled[None, :], mask=qk_ok[:, None], other=0.0).to(tl.float32)
    y = (x * cos[None, :] + xr * sin[None, :]).to(QOUT.dtype.element_ty)  # [H_PAD, D]
    is_q = h < HQ
    tl.store(QOUT + t.to(tl.int64) * s_qo + h[:, None] * D + d[None, :], y, mask=is_q[:, None])
    slot = tl.load(SLOTS + t).to(tl.int64)
    is_k = (h >= HQ) & qk_ok
    tl.store(KP + slot * s_kslot + (h[:, None] - HQ) * D + d[None, :], y.to(KP.dtype.element_ty), mask=is_k[:, None])
    hv = tl.arange(0, H_PAD)
    v_ok = hv < HKV
    v = tl.load(row + (HQ + HKV) * D + hv[:, None] * D + d[None, :], mask=v_ok[:, None], other=0.0)
    tl.store(VP + slot * s_vslot + hv[:, None] * D + d[None, :], v.to(VP.dtype.element_ty), mask=v_ok[:, None])


def rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, k_pool: torch.Tensor,
               v_pool: torch.Tensor, slots: torch.Tensor, q_heads: int, kv_heads: int) -> torch.Tensor:
    """qkv: [T, (q_heads + 2 kv_heads) * D]; cos, sin_signed: [T, D] (engine/rope.RotaryTable rows); pools
    [P, page_size, kv_heads, D]; slots [T] -> q [T, q_heads, D] with RoPE applied (K, V stored)."""
    t, dim = qkv.shape[0], cos.shape[-1]
    q = torch.empty((t, q_heads, dim), dtype=qkv.dtype, device=qkv.device)
    assert qkv.stride(1) == 1 and cos.stride(-1) == 1 and k_pool.is_contiguous() and v_pool.is_contiguous()
    slot_stride = kv_heads * dim  # pools viewed as [P * page_size, kv_heads, D]
    _rope_write_kernel[(t,)](qkv, cos, sin_signed, k_pool, v_pool, slots, q, qkv.stride(0), cos.stride(0),
                             slot_stride, slot_stride, q.stride(0), HQ=q_heads, HKV=kv_heads, D=dim,
                             H_PAD=triton.next_power_of_2(q_heads + kv_heads), num_warps=4)
    return q


@triton.jit
def _add_rms_norm_kernel(X, DELTA, W, OUT, RES, s_x, s_d, s_o, s_r, eps, N: tl.constexpr, N_PAD: tl.constexpr,
                         HAS_DELTA: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, N_PAD)
    ok = c < N
    x = tl.load(X + r * s_x + c, mask=ok, other=0.0)
    if HAS_DELTA:
        delta = tl.load(DELTA + r * s_d + c, mask=ok, other=0.0).to(tl.float32)
        x = (x.to(tl.float32) + delta).to(RES.dtype.element_ty)
        tl.store(RES + r * s_r + c, x, mask=ok)
    xf = x.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(xf * xf, 0) / N + eps)
    w = tl.load(W + c, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + r * s_o + c, (xf * inv * w).to(OUT.dtype.element_ty), mask=ok)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta: [T, N] -> (rms_norm(x + delta) * weight, x + delta); delta None: (rms_norm(x) * weight, x)."""
    t, n = x.shape
    out = torch.empty_like(x)
    res = torch.empty_like(x) if delta is not None else x
    d = delta if delta is not None else x
    _add_rms_norm_kernel[(t,)](x, d, weight, out, res, x.stride(0), d.stride(0), out.stride(0), res.stride(0), eps,
                               N=n, N_PAD=triton.next_power_of_2(n), HAS_DELTA=delta is not None, num_warps=4)
    return out, res


@triton.jit
def _silu_mul_kernel(GU, OUT, s_gu, s_o, I: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < I
    g = tl.load(GU + r * s_gu + c, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GU + r * s_gu + I + c, mask=ok, other=0.0).to(tl.float32)
    # silu rounded to the input dtype before the product, as torch's two ops do
    s = (g / (1.0 + tl.exp(-g))).to(GU.dtype.element_ty).to(tl.float32)
    tl.store(OUT + r * s_o + c, (s * u).to(OUT.dtype.element_ty), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2 * I] (gate then up) -> silu(gate) * up [T, I]."""
    t, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty((t, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(t, triton.cdiv(inter, block))](gate_up, out, gate_up.stride(0), out.stride(0), I=inter,
                                                      BLOCK=block, num_warps=4)
    return out
