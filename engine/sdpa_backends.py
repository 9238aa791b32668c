"""The SDPA backends attention may use on CUDA, named once per forward (`LlamaForward.forward`).

Why: with every backend enabled (PyTorch's default), one decode-shaped `scaled_dot_product_attention` call
cost ~2 ms of host time on an H100 (torch 2.11+cu130), the whole of a small-batch decode step (30 layers:
~60 ms), against 30-150 us with the backends named (measured by a probe since retired; figures in
bench/gpu_results/). Flash first, then memory-efficient attention (it takes the masks of bucketed decode
groups and chunked prefill), then math as the fallback every shape has. cuDNN is left out by default.
`PDSERVE_CUDA_SDPA=cudnn,flash,...` names another list (A/B runs); CPU keeps PyTorch's own choice.
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

_TABLE = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
          "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
DEFAULT = "flash,efficient,math"


def cuda_backends(spec: str | None = None) -> list:
    """The backends `spec` names (default: PDSERVE_CUDA_SDPA, else DEFAULT), in order."""
    return list(_parsed(spec or os.environ.get("PDSERVE_CUDA_SDPA") or DEFAULT))


@functools.lru_cache(maxsize=8)
def _parsed(spec: str) -> tuple:
    """Parsed once per distinct spec: `sdpa_context` runs once per forward step."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    bad = [n for n in names if n not in _TABLE]
    if bad or not names:
        raise ValueError(f"PDSERVE_CUDA_SDPA: unknown backend(s) {bad or names}; name some of {', '.join(_TABLE)}")
    return tuple(_TABLE[n] for n in names)


def sdpa_context(device: torch.device):
    """A context manager for one forward on `device`: the named backends on CUDA, nothing elsewhere."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel(cuda_backends())
