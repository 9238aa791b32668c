"""Quantized KV storage formats: "int8" and "fp8" (e4m3), each with one float16 scale per (token, head).

Who uses it: `engine.kv_cache.backend.make_backend` picks `QuantizedKVBackend` when the `KVPageSpec` names
one of these formats; the model sees the same `write` / `attend` as with raw pages. The KV-transfer layer
moves the stored bytes unchanged (`page_io`): the wire format is the storage format.

Storage per layer, for K and for V: uint8 `[num_pages, page_size, kv_heads, head_dim + 2]`; the first
`head_dim` bytes of a (token, head) cell are its values (int8, or fp8 e4m3 bits), the last two its scale
(float16 bytes), then zeros up to `spec.cell_align` (16 where the Triton kernel reads the cells: every load
16-byte aligned; the spec's signature carries it, so a transfer between differently padded pools is refused
as any layout mismatch is). One cell per token and head keeps every format token-addressed, so transfers between
pools of different page sizes and KV-head sub-ranges work as for raw pages. Why a per-(token, head)
scale: keys after RoPE and values vary by orders of magnitude between heads and tokens; one scale per
64 values costs 2 bytes (66 vs 128 bytes per cell in bfloat16: 0.52x).

Rotation: cells hold K and V *rotated* by a fixed orthonormal Hadamard matrix H over head_dim (block
diagonal with power-of-two blocks when head_dim is not one). Keys have outlier channels; a per-token
scale set by the outlier leaves the other channels a coarse grid, and that error in the keys is what
moves perplexity (SmolLM2 bf16, 2048 + 512 tokens: int8 +0.74% unrotated, -0.11% rotated; fp8 +2.1%
vs +0.20%). H spreads an outlier over all channels. Attention never rotates the cache back: scores are
invariant (qH . kH = q . k) and softmax(.) VH = (softmax(.) V) H, so the backend rotates the step's
queries in and its outputs out, a [new tokens, head_dim] matmul each. `read()` returns unrotated values.

Quantize (on write): scale = absmax / qmax, rounded to float16 first so that quantize and dequantize use
the same scale; int8: round(x / scale) clamped to [-127, 127]; fp8: (x / scale) cast to e4m3 (qmax 448).
Dequantize (on attend): values * scale in float32, then the compute dtype, only for the pages a step reads.
"""
from __future__ import annotations

import torch

from engine import kernels
from engine.attention_context import AttentionContext, AttnGroup
from engine.kv_cache.raw import RawKVBackend, torch_dtype
from engine.kv_cache.spec import KVPageSpec

SCALE_BYTES = 2  # one float16 per (token, head)
_QMAX = {"int8": 127.0, "fp8": 448.0}
_TINY = 2.0 ** -14  # smallest normal float16 scale: rows with absmax < qmax * 2^-14 (~0.008 for int8) get
# this step (absolute error <= 3e-5), which keeps the scale's own rounding at float16 precision


def quantize(x: torch.Tensor, fmt: str, width: int | None = None) -> torch.Tensor:
    """x: [..., head_dim] (any float dtype) -> stored cells uint8 [..., width] (head_dim + 2 unless padded:
    values, scale, zeros)."""
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / _QMAX[fmt]).clamp_min(_TINY).to(torch.float16)  # [..., 1]
    y = xf / scale.float()
    if fmt == "int8":
        q = y.round_().clamp_(-127, 127).to(torch.int8).view(torch.uint8)
    else:  # (clamped: the float16 scale may round down, and e4m3fn has no infinity to saturate to)
        q = y.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    parts = [q, scale.view(torch.uint8)]
    if width is not None and width > x.shape[-1] + SCALE_BYTES:
        parts.append(q.new_zeros(*q.shape[:-1], width - x.shape[-1] - SCALE_BYTES))
    return torch.cat(parts, dim=-1)


def dequantize(cells: torch.Tensor, fmt: str, dtype: torch.dtype, head_dim: int | None = None) -> torch.Tensor:
    """cells: uint8 [..., head_dim + 2 (+ padding)] -> values [..., head_dim] in `dtype`."""
    d = cells.shape[-1] - SCALE_BYTES if head_dim is None else head_dim
    raw = cells[..., :d]
    vals = raw.view(torch.int8) if fmt == "int8" else raw.view(torch.float8_e4m3fn)
    scale = cells[..., d:d + SCALE_BYTES].contiguous().view(torch.float16)  # [..., 1]
    return (vals.float() * scale.float()).to(dtype)


def hadamard(n: int) -> torch.Tensor:
    """Orthonormal [n, n] float32: Sylvester Hadamard blocks of the largest power of two dividing n."""
    block = n & -n
    h = torch.ones(1, 1)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return torch.block_diag(*[h / block ** 0.5] * (n // block))


def _rotate(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] @ h, in float32, back in x's dtype."""
    return (x.float() @ h).to(x.dtype)


class QuantizedKVBackend(RawKVBackend):
    """Pages hold quantized K and V cells; attention reads dequantized copies of the pages it needs."""

    def __init__(self, spec: KVPageSpec, num_pages: int, device: str | torch.device = "cpu"):
        assert spec.storage_format in _QMAX, spec.storage_format
        self.spec = spec
        self.num_pages = num_pages
        self.storage_format = spec.storage_format
        self.compute_dtype = torch_dtype(spec.dtype)
        self.h = hadamard(spec.head_dim).to(device)  # rotation of stored cells (see the module map)
        # int8 cells on the Triton path: decode/verify read them in place, dequantizing as they load (and a
        # scratch page past the pool for CUDA-graph padding rows, as RawKVBackend); their cells padded to 16
        # bytes (`spec.cell_align`): unaligned 130-byte cells made the kernel 46x slower (run4). Only when
        # asked for (engine/kernels.quantized_triton) until its engine step is measured.
        self.triton_paged = kernels.quantized_triton(spec.storage_format)
        assert not self.triton_paged or spec.token_head_bytes() % 16 == 0, "the Triton path reads aligned cells"
        self._sm_count = kernels.sm_count(torch.device(device))
        self.scratch_slot = num_pages * spec.page_size if self.triton_paged else None
        shape = (num_pages + int(self.triton_paged), spec.page_size, spec.num_kv_heads, spec.token_head_bytes())
        self.k: list[torch.Tensor | None] = [None] * spec.num_layers
        self.v: list[torch.Tensor | None] = [None] * spec.num_layers
        for layer in spec.local_layers:
            self.k[layer] = torch.zeros(shape, dtype=torch.uint8, device=device)
            self.v[layer] = torch.zeros(shape, dtype=torch.uint8, device=device)

    def _flat(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(-1, self.spec.num_kv_heads, t.shape[-1])  # [num_slots, kv_heads, cell bytes]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [num_tokens, kv_heads, head_dim] -> quantized cells at the flat slots."""
        width = self.spec.token_head_bytes()
        self._flat(self.k[layer]).index_copy_(0, slots, quantize(k.float() @ self.h, self.storage_format, width))
        self._flat(self.v[layer]).index_copy_(0, slots, quantize(v.float() @ self.h, self.storage_format, width))
        if self.summaries is not None:
            self.summaries.update(layer, slots)

    def _triton_cells(self) -> bool:
        return self.storage_format == "int8"

    def _summary_dtype(self) -> torch.dtype:
        return self.compute_dtype

    def _summary_keys(self, layer: int, pages: torch.Tensor) -> torch.Tensor:
        """Dequantized keys of whole pages, still rotated (queries are scored in the rotated space)."""
        return self._dq(self.k[layer].index_select(0, pages))

    def _dq(self, cells: torch.Tensor) -> torch.Tensor:
        return dequantize(cells, self.storage_format, self.compute_dtype, self.spec.head_dim)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized, unrotated K and V at the given flat slots: each [*slots.shape, kv_heads, head_dim]."""
        flat = slots.reshape(-1)
        k = _rotate(self._dq(self._flat(self.k[layer]).index_select(0, flat)), self.h.T)
        v = _rotate(self._dq(self._flat(self.v[layer]).index_select(0, flat)), self.h.T)
        tail = (self.spec.num_kv_heads, self.spec.head_dim)
        return k.view(*slots.shape, *tail), v.view(*slots.shape, *tail)

    def _page_heads(self, layer: int, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = super()._page_heads(layer, pages)  # cells
        return self._dq(k), self._dq(v)  # still rotated, as the queries sparse attention gets

    def _load(self, layer: int, g: AttnGroup) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = super()._load(layer, g)  # cells of the pages (or the view) this group reads
        return self._dq(k), self._dq(v)  # [B, ctx, kv_heads, head_dim], still rotated

    def _attend_group(self, layer: int, q: torch.Tensor, g: AttnGroup, ctx: AttentionContext) -> torch.Tensor:
        """Attention in the rotated space: queries rotated in, outputs rotated back out."""
        return _rotate(super()._attend_group(layer, _rotate(q, self.h), g, ctx), self.h.T)


QUANTIZED_FORMATS = tuple(_QMAX)  # the names `backend.BACKENDS` maps to QuantizedKVBackend
