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

A stage does not recompute the frequencies, angles, cosines and sines in every layer: a
backbone holds a ``RotaryTable`` (cos and sin of every position up to the longest row
seen, built once per device), and each forward over a stage's layers looks its
positions up once (``RotaryTable.rotation``: a slice for positions ``0..S-1``, one gather
for packed documents) and hands the same ``Rotation`` to every layer. The table's entries
are the same float32 products and cosines ``apply_rotary`` computes, so both rotate
alike (equal up to a float32 ulp where a vectorised and a scalar cosine differ).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch._guards import detect_fake_mode

from dtdsl.ir import program as ir

__all__ = ["Rotation", "RotaryTable", "apply_rotary", "inverse_frequencies"]


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


@dataclass(eq=False)
class Rotation:
    """The cosines and sines of one forward's positions, ``[B or 1, S, 1, head_dim]``
    float32, shared by every layer of the forward; cast once per compute dtype."""

    cos: torch.Tensor
    sin: torch.Tensor
    _cast: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``[B, S, H, D]`` queries and keys (``apply_rotary``'s rule)."""
        if torch.compiler.is_compiling():
            # A compiled block fuses the casts; a cache written here would be a side
            # effect dynamo guards on (one more graph per dtype seen).
            cos, sin = self.cos.to(q.dtype), self.sin.to(q.dtype)
        else:
            found = self._cast.get(q.dtype)
            if found is None:
                found = self._cast[q.dtype] = (self.cos.to(q.dtype), self.sin.to(q.dtype))
            cos, sin = found
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class RotaryTable:
    """Cos and sin (scaled by the rope's attention factor) of positions ``0..n-1`` for
    one backbone, built on first use on each device and grown (doubling) when a longer
    row comes: ``rotation(positions, length, device)`` looks a forward's positions up."""

    def __init__(self, rope: ir.RoPE, head_dim: int):
        self.rope, self.head_dim = rope, head_dim
        self._tables: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def _table(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        # A table made under a fake mode (``dtc memcheck``) holds fake tensors: keyed apart.
        fake = detect_fake_mode()
        key = (str(device), 0 if fake is None else id(fake))
        found = self._tables.get(key)
        if found is not None and found[0].shape[0] >= length:
            return found
        # Always longer than the rows it serves: a compiled block's input is a view of
        # this table, and dynamo would give the table and a row of equal length one
        # symbol, then compile again for the next length.
        size = max(length + 1, 2 * found[0].shape[0] if found is not None else 0)
        inv_freq, scale = inverse_frequencies(self.rope, self.head_dim, device=device)
        angles = torch.arange(size, device=device).float().unsqueeze(-1) * inv_freq
        angles = torch.cat([angles, angles], dim=-1)                  # [size, D]
        cos, sin = angles.cos(), angles.sin()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        self._tables[key] = (cos, sin)
        return cos, sin

    def rotation(self, positions: torch.Tensor | None, length: int,
                 device: torch.device) -> Rotation:
        """The rotation of positions ``0..length-1`` (``positions`` None) or of
        ``positions`` (``[S]`` or ``[B, S]``, each below ``length``)."""
        cos, sin = self._table(length, device)
        if positions is None:
            cos, sin = cos[:length].unsqueeze(0), sin[:length].unsqueeze(0)   # [1, S, D]
        else:
            cos, sin = cos[positions], sin[positions]
            if cos.dim() == 2:
                cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
        return Rotation(cos.unsqueeze(2), sin.unsqueeze(2))
