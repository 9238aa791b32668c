"""Linear layers for the forward pass: oneDNN-prepacked weights for bf16/fp16 on CPU, F.linear otherwise,
and for bf16 on CPU at one or two rows (decode at batch 1-2) the numba GEMV of `engine.kernels.cpu.numba_kernels`.

Why: torch's default CPU GEMV for bfloat16 runs well below memory bandwidth (measured 5.4 GB/s vs 7.8 GB/s
prepacked on this machine, where bandwidth is the limit at batch 1), and decode at small batch is a chain
of GEMVs. float32 keeps plain `F.linear`, so float32 logits match Hugging Face bit for bit. Later, on
the same machine, oneDNN's GEMV measured ~3.6-4 GB/s in a run where the numba kernel read ~6 GB/s
(`cpu_kernels`): rows up to `cpu_kernels.MAX_ROWS` go there. Where oneDNN cannot pack half-precision
weights (its bf16 path needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT; an AVX2-only AMD EPYC raised), larger
rows run on a float32 copy of the weight: torch's own bf16 GEMM there was ~10x slower than float32.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from engine.kernels.cpu import numba_kernels as cpu_kernels
from engine.kernels.cpu.numba_kernels import bits, from_bits


PACK_ROWS = 16  # the batch size oneDNN packs bf16 weights for (see Linear.__init__)


@functools.cache
def _packing_available(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs `dtype` weights on this CPU: tried once on a small weight, since its bf16 path
    needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT and raises on AVX2-only machines (seen on an AMD EPYC)."""
    if not (hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.backends.mkldnn.is_available()):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), PACK_ROWS)
    except RuntimeError:
        return False
    return True


class Linear:
    """y = x @ weight.T + bias, with weight [out_features, in_features]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight
        self.bias = bias
        self.out_features = weight.shape[0]
        self.gemv = None  # (weight bits, bias bits) for the numba GEMV: bf16 on CPU
        if weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2:
            self.gemv = (bits(weight), None if bias is None else bits(bias))
        self.packed = None
        self.widened = None  # (weight, bias) in float32: half-precision CPU weights oneDNN cannot pack
        if weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float16):
            if _packing_available(weight.dtype):
                # oneDNN picks its blocking from the batch size given here: packed for 1 row it is a GEMV
                # layout, ~20-30% slower at 3-512 rows than one packed for 16 (any size >= 4 measured the same)
                rows = PACK_ROWS if self.gemv is not None else 1  # bf16's single rows go to the GEMV
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
            else:
                # torch's own bf16 GEMM on an AVX2-only CPU ran ~10x slower than float32 (16 x 576 x 1536:
                # 14 vs 1.4 ms); a float32 copy accumulates in float32 and rounds once, as oneDNN does
                self.widened = (weight.float(), None if bias is None else bias.float())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._takes_gemv(x):
            return from_bits(cpu_kernels.gemv_bf16(self.gemv[0], bits(x), self.gemv[1]))
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.widened is not None:
            return F.linear(x.float(), *self.widened).to(x.dtype)
        return F.linear(x, self.weight, self.bias)

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + self(x); the packed path fuses the add into the matmul (one op fewer), and so does
        the numba GEMV (one rounding to bf16, after the add, as oneDNN's)."""
        if self._takes_gemv(x) and residual.dtype == torch.bfloat16 \
                and residual.shape == (x.shape[0], self.out_features):
            return from_bits(cpu_kernels.gemv_bf16(self.gemv[0], bits(x), self.gemv[1], bits(residual)))
        if self.packed is not None and self.bias is None:
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, None, "add")
        if self.widened is not None and self.bias is None and x.dim() == 2 \
                and residual.shape == (x.shape[0], self.out_features):  # one rounding, as the fused paths
            return torch.addmm(residual.float(), x.float(), self.widened[0].t()).to(residual.dtype)
        return residual + self(x)  # float32: HF's own two steps, so logits match it bit for bit

    def _takes_gemv(self, x: torch.Tensor) -> bool:
        """bf16 on CPU, a few rows: the numba GEMV (read at call time: tests move `MAX_ROWS`)."""
        return self.gemv is not None and x.dim() == 2 and x.shape[0] <= cpu_kernels.MAX_ROWS

    def nbytes(self) -> int:
        n = self.weight.numel() * self.weight.element_size()
        if self.widened is not None:
            n += self.widened[0].numel() * 4
        return n + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())
