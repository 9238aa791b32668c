"""Rotary position embedding tables (default, linear and llama3 scaling), indexed by explicit positions.

The table is built once per model in float32 the way Hugging Face builds it (outer product of positions
and inverse frequencies, then cos/sin), so float32 logits match the reference bit for bit in this step.
"""
from __future__ import annotations

import math

import torch

from engine.errors import UnsupportedArchitectureError

ROPE_TYPES = ("default", "linear", "llama3")


def inverse_frequencies(head_dim: int, rope: dict) -> tuple[torch.Tensor, float]:
    base = float(rope.get("rope_theta", 10000.0))
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / float(rope["factor"]), 1.0
    if kind == "llama3":
        return _llama3(inv, rope), 1.0
    raise UnsupportedArchitectureError(f"rope_type={kind}", ROPE_TYPES)


def _llama3(inv: torch.Tensor, rope: dict) -> torch.Tensor:
    factor = rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    old_ctx = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryTable:
    def __init__(self, head_dim: int, rope: dict, max_position: int, dtype: torch.dtype, device="cpu"):
        inv, scaling = inverse_frequencies(head_dim, rope)
        pos = torch.arange(max_position, dtype=torch.float32)
        freqs = pos[:, None] * inv[None, :]  # [max_position, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * scaling).to(dtype=dtype, device=device)  # [max_position, head_dim]
        sin = (emb.sin() * scaling).to(dtype=dtype, device=device)
        half = head_dim // 2
        # rotate_half(x) * sin == roll(x, half) * [-sin_lo, sin_hi]: one roll instead of two slices, a neg
        # and a cat per call (negating a factor is exact, so float32 results do not change).
        self.sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for the given positions, shaped [num_tokens, 1, head_dim] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim]; sin_signed from `RotaryTable.lookup`."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed
