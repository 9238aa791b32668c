"""SwiGLU's activation for bfloat16 on CPU by the C kernel of `engine/kernels/cpu/csrc/swiglu_bf16.c`: silu(gate) * up
in one pass over the fused gate/up projection (`LlamaForward`), rounded where Hugging Face rounds.

Why: torch runs it as a chunk, a silu and a mul: ~40 us a layer at 16 rows, ~1 ms at 512 on the AMD
machine of stop 20, ~3% of a 512-token prefill step. Where the kernel does not run here
(`engine.kernels.cpu.native`), `swiglu` computes the same two torch ops.

    swiglu(gate_up) -> out    # gate_up [tokens, 2 * inter] (gate then up) -> [tokens, inter], same dtype
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.cpu import native as cpu_native


def _lib():
    return cpu_native.library("swiglu_bf16")


def available() -> bool:
    """Whether the kernel runs here (and, called at model load, builds or loads it then)."""
    return _lib() is not None


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [tokens, 2 * inter]; the kernel for contiguous bf16 CPU rows."""
    if gate_up.dtype == torch.bfloat16 and gate_up.device.type == "cpu" and gate_up.dim() == 2 \
            and gate_up.is_contiguous() and gate_up.shape[1] % 2 == 0:
        lib = _lib()
        if lib is not None:
            rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
            out = torch.empty((rows, inter), dtype=torch.bfloat16)
            lib.pd_swiglu_bf16(gate_up.data_ptr(), rows, inter, out.data_ptr())
            return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
