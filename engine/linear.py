"""Linear layers for the forward pass: oneDNN-prepacked weights for bf16/fp16 on CPU, F.linear otherwise.

Why: torch's default CPU GEMV for bfloat16 runs well below memory bandwidth (measured 5.4 GB/s vs 7.8 GB/s
prepacked on this machine, where bandwidth is the limit at batch 1), and decode at small batch is a chain
of GEMVs. float32 keeps plain `F.linear`, so float32 logits match Hugging Face bit for bit.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _packing_available() -> bool:
    return hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.backends.mkldnn.is_available()


class Linear:
    """y = x @ weight.T + bias, with weight [out_features, in_features]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight
        self.bias = bias
        self.out_features = weight.shape[0]
        self.packed = None
        if weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float16) and _packing_available():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + self(x); the packed path fuses the add into the matmul (one op fewer)."""
        if self.packed is not None and self.bias is None:
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, None, "add")
        return residual + F.linear(x, self.weight, self.bias)

    def nbytes(self) -> int:
        n = self.weight.numel() * self.weight.element_size()
        return n + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())
