"""What an audio tower adds to ``transformer.Encoder``: Whisper's stem.

``WhisperStem`` is the first pipeline stage's input embedding of an encoder whose
``ir.TransformerArch.stem`` is ``"whisper_conv"`` (it sits where a ViT's patch embedding
does, ``Encoder.patch_embed``, so that stages past the first drop it the same way): log-mel
frames ``[B, T, mel_bins]`` through ``conv1`` (kernel 3, padding 1) and ``conv2`` (kernel
3, stride 2, padding 1), each followed by exact GELU, plus Whisper's fixed sinusoidal
positions: ``[B, T / 2, hidden]``, what ``transformers``' ``WhisperEncoder`` feeds its first
layer. The positions are computed, not stored (``whisper_positions``; the checkpoint's
``embed_positions`` holds the same numbers, which ``models.hf`` checks when it loads one):
they do not train, as in ``transformers``, where that embedding is frozen.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["WhisperStem", "whisper_positions"]


def whisper_positions(length: int, dim: int, device: torch.device | None = None, *,
                      start: int = 0) -> torch.Tensor:
    """Whisper's sinusoids (``transformers``' ``sinusoids``; OpenAI's) of positions
    ``start .. start + length - 1``: float32 ``[length, dim]``, sines then cosines,
    timescales from 1 to 10000 over ``dim / 2 - 1`` steps. ValueError for an odd
    ``dim``."""
    if dim % 2 or dim < 4:
        raise ValueError(f"Whisper's positions need an even width of at least 4, not {dim}")
    step = math.log(10_000) / (dim // 2 - 1)
    inv = torch.exp(-step * torch.arange(dim // 2, dtype=torch.float32, device=device))
    at = torch.arange(start, start + length, dtype=torch.float32, device=device)
    angles = at[:, None] * inv[None]
    return torch.cat([angles.sin(), angles.cos()], dim=1)


class WhisperStem(nn.Module):
    """Whisper's convolutional stem and positions (module docstring). It takes clips of
    exactly ``2 * positions`` frames (Whisper pads every clip to 30 s: 3000 frames for
    1500 positions), as ``transformers`` does; ValueError otherwise."""

    def __init__(self, mel_bins: int, hidden: int, positions: int):
        super().__init__()
        if hidden % 2:
            raise ValueError(f"Whisper's positions need an even width, not {hidden}")
        self.positions = positions
        self.conv1 = nn.Conv1d(mel_bins, hidden, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(hidden, hidden, kernel_size=3, stride=2, padding=1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        frames = features.shape[1]
        if frames != 2 * self.positions:
            raise ValueError(f"Whisper's encoder reads clips of {2 * self.positions} frames "
                             f"(padded to 30 s), not {frames}")
        x = F.gelu(self.conv1(features.transpose(1, 2)))
        x = F.gelu(self.conv2(x)).transpose(1, 2)
        return x + whisper_positions(self.positions, x.shape[-1], x.device).to(x.dtype)
