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


def quantized_triton(storage_format: str) -> bool:
    """Whether int8 pages take the Triton paged kernel (their cells then padded to 16 bytes: `cell_align`).
    Only when asked for (PDSERVE_ATTENTION=triton) until its engine step is measured at the floor target:
    bench/gpu_results/2026-11-27 (run4: the kernel alone on 144-byte cells 0.49 ms a layer at b=128 x 2k,
    bf16 pages 0.33 ms; 130-byte cells 22.6 ms)."""
    return storage_format == "int8" and attention_choice() == "triton"


def cell_align(storage_format: str) -> int:
    """Bytes an int8/fp8 cell is padded to a multiple of: 16 where the Triton kernel reads the cells (a
    130-byte cell made no load 16-byte aligned: 46x slower), 1 elsewhere (no padding)."""
    return 16 if quantized_triton(storage_format) else 1


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (the paged kernel's split choice); 4 elsewhere."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count
