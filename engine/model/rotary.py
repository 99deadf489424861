"""Rotary position embeddings with the scaling schemes of Llama-family configs.

The inverse frequencies follow each scheme's published definition (linear, dynamic NTK, Llama 3,
YaRN); cos/sin for every position are tabulated once, in float32.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pdserve.engine.model import fused


def inverse_frequencies(head_dim: int, params: dict[str, Any], max_positions: int) -> tuple[torch.Tensor, float]:
    """Return (inv_freq [head_dim/2], attention scaling applied to cos and sin)."""
    base = float(params.get("rope_theta", 10000.0))
    kind = params.get("rope_type", "default")
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (base ** exponents)
    if kind == "default":
        return inv_freq, 1.0
    factor = float(params["factor"])
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "dynamic":
        # Static form of dynamic NTK at the configured context: the base grows with the scaled length.
        original = params.get("original_max_position_embeddings", max_positions)
        base = base * ((factor * max_positions / original) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (base ** exponents), 1.0
    if kind == "llama3":
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        original = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= original / high) & (wavelen <= original / low)
        return torch.where(medium, blended, scaled), 1.0
    if kind == "yarn":
        original = params.get("original_max_position_embeddings", max_positions)
        beta_fast, beta_slow = params.get("beta_fast", 32), params.get("beta_slow", 1)

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        inv_freq = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
        mscale = params.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
        return inv_freq, float(mscale)
    raise ValueError(f"unsupported rope_type {kind!r}")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, params: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        inv_freq, scaling = inverse_frequencies(head_dim, params, max_positions)
        self.rotary_dim = inv_freq.numel() * 2
        self.head_dim = head_dim
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        angles = torch.cat([freqs, freqs], dim=-1)
        # Kept in float32 and applied in float32, as the reference implementation does.
        self.register_buffer("cos", angles.cos() * scaling, persistent=False)
        self.register_buffer("sin", angles.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [tokens, heads, dim] and k [tokens, kv_heads, dim] by their positions (in place
        where a fused kernel runs; see fused.rotate_qk)."""
        return fused.rotate_qk(positions, q, k, self.cos, self.sin, self.rotary_dim)
