"""The engine's kernels, chosen here at one point.

`cuda/` (Triton, CUDA graphs): paged attention (`paged_attention.py`: decode and 1 + k verify queries
reading KV pages in place), the fused forward (`fused_ops.py`, `fused_forward.py`) and CUDA-graph decode
(`graph_decode.py`). `cpu/` (numba, and C built at first use by `native.py` from `csrc/`): the bf16 GEMV
and RMSNorm (`numba_kernels.py`), paged decode attention (`decode_attention.py`), multi-query prefill
attention (`prefill_attention.py`), SwiGLU's activation (`activations.py`), Quest's page choice
(`quest_select.py`). `reference.py`: plain torch oracles the CUDA kernels' tests compare against (the CPU
kernels keep their references beside them).

Choice: `PDSERVE_ATTENTION` = "auto" (default: the Triton paged kernel on CUDA, the CPU kernels and SDPA
elsewhere), "triton" (the Triton kernel wherever it runs: on CPU that is Triton's interpreter, set
`TRITON_INTERPRET=1`, used by the tests) or "torch" (SDPA on gathered pages: the eager reference on CUDA).
"""
from __future__ import annotations

import functools
import importlib.util
import os

import torch

CHOICES = ("auto", "triton", "torch")


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def attention_choice() -> str:
    choice = os.environ.get("PDSERVE_ATTENTION", "auto") or "auto"
    if choice not in CHOICES:
        raise ValueError(f"PDSERVE_ATTENTION={choice!r}: name one of {', '.join(CHOICES)}")
    return choice


def triton_paged_attention(device: str | torch.device) -> bool:
    """Whether attention over raw KV pages on `device` goes through the Triton paged kernel."""
    choice = attention_choice()
    if choice == "triton":
        if not triton_available():
            raise RuntimeError("PDSERVE_ATTENTION=triton but the triton package is not installed")
        return True
    return choice == "auto" and torch.device(device).type == "cuda" and triton_available()


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (the paged kernel's split choice); 4 elsewhere."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count
