"""Rotary position embeddings with the frequency scalings of Hugging Face's Llama family.

``inverse_frequencies(rope, head_dim)`` gives the ``head_dim / 2`` inverse frequencies and
the factor that scales cos and sin (YaRN's attention factor; 1 otherwise) for a
``ir.RoPE``: ``default`` (``theta ** -(2i / d)``), ``linear`` (divided by ``factor``),
``llama3`` (Llama 3.1's smooth split between low and high frequencies), ``yarn`` and
``dynamic`` (NTK; it equals ``default`` at every length up to ``max_positions``, the only
lengths a training step runs at, which the checker enforces). The formulas are
``transformers.modeling_rope_utils``'s, computed the same way (float32 frequencies), so
positions rotate exactly as the Hugging Face model rotates them.

``apply_rotary`` rotates queries and keys in the rotate-half layout that Hugging Face's
Llama, Mistral and Qwen2 checkpoints use (no permutation of their projections needed).
"""

from __future__ import annotations

import math

import torch

from dtdsl.ir import program as ir

__all__ = ["apply_rotary", "inverse_frequencies"]


def _base(theta: float, dim: int, device: torch.device | None) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    return 1.0 / (theta ** exponents)


def _llama3(rope: ir.RoPE, inv_freq: torch.Tensor) -> torch.Tensor:
    old = rope.original_max_positions
    if old is None:
        raise ValueError("llama3 rope scaling needs original_max_positions")
    low_wavelen = old / rope.low_freq_factor
    high_wavelen = old / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor
                                                       - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: ir.RoPE, dim: int, device: torch.device | None) -> tuple[torch.Tensor, float]:
    original = rope.original_max_positions
    if original is None:
        raise ValueError("yarn rope scaling needs original_max_positions")
    factor = rope.factor
    attention = rope.attention_factor
    if attention is None:
        if rope.mscale and rope.mscale_all_dim:
            attention = _mscale(factor, rope.mscale) / _mscale(factor, rope.mscale_all_dim)
        else:
            attention = _mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp.to(device)
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, device=device).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + \
        (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def inverse_frequencies(rope: ir.RoPE, head_dim: int, *,
                        device: torch.device | None = None) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim / 2] float32, scale of cos and sin)`` (module docstring)."""
    if rope.scaling == "yarn":
        return _yarn(rope, head_dim, device)
    inv_freq = _base(rope.theta, head_dim, device)
    if rope.scaling == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.scaling == "llama3":
        return _llama3(rope, inv_freq), 1.0
    return inv_freq, 1.0     # default, and dynamic within max_positions


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rope: ir.RoPE
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``[B, S, H, D]`` queries and keys by ``positions`` (``[S]`` or ``[B, S]``)."""
    inv_freq, scale = inverse_frequencies(rope, q.shape[-1], device=q.device)
    angles = positions.float().unsqueeze(-1) * inv_freq           # [..., S, D/2]
    angles = torch.cat([angles, angles], dim=-1)
    if angles.dim() == 2:                                          # [S, D]: shared by the batch
        angles = angles.unsqueeze(0)
    cos, sin = angles.cos(), angles.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    cos = cos.unsqueeze(2).to(q.dtype)                             # [B or 1, S, 1, D]
    sin = sin.unsqueeze(2).to(q.dtype)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
