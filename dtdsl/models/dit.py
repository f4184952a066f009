"""A diffusion transformer with cross-attention, built from a ``DiTArch``.

It mirrors ``flops.dit_forward`` and ``flops.module_params``: a linear patch
embedding, ``layers`` blocks of adaLN-modulated self-attention, cross-attention to
the conditioning (PixArt-style, unmodulated) and an adaLN-modulated GELU MLP, and
a final linear projection back to patches. Linear layers carry no biases and the
LayerNorms no affine parameters (adaLN supplies scale and shift). The timestep
enters as its sinusoidal code of width ``hidden`` fed straight to each block's
adaLN projection, without DiT's two-layer timestep MLP and final-layer
modulation, which ``flops`` does not count either (about 0.2% of DiT-XL).

Tensor parallelism: heads and the MLP width are divided by ``tp``; each block's
adaLN projection is row-parallel over a slice of the replicated conditioning; the
patch embedding and the final projection are replicated (see ``transformer.py``
for what a shard does and leaves out).

Pipeline parallelism: ``forward`` is ``embed``, ``run_blocks`` and ``unembed`` in turn, and
a pipeline stage runs its share of them (``train.passes``): the first embeds, each its
blocks (``blocks`` is keyed by the block's index, so a stage that deletes the others keeps
every name the whole model has), the last unembeds. Every block reads the timestep code
and the context: a stage makes the code from the timesteps (``timestep_code``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dtdsl.ir import program as ir
from dtdsl.models.transformer import (
    MLP,
    CrossAttention,
    SelfAttention,
    shard_size,
    sinusoidal_embedding,
)

__all__ = ["DiT", "DiTBlock"]


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


class DiTBlock(nn.Module):
    """``forward(x [B, N, hidden], cond [B, hidden], context [B, M, context_dim])``."""

    def __init__(self, arch: ir.DiTArch, *, tp: int = 1):
        super().__init__()
        h = arch.hidden
        heads = shard_size(arch.heads, tp, "attention heads")
        head_dim = h // arch.heads
        self.tp = tp
        self.norm1 = nn.LayerNorm(h, elementwise_affine=False, eps=1e-6)
        self.attn = SelfAttention(h, heads, heads, head_dim)
        self.norm2 = nn.LayerNorm(h, elementwise_affine=False, eps=1e-6)
        self.cross = CrossAttention(h, arch.context_dim, heads, head_dim)
        self.norm3 = nn.LayerNorm(h, elementwise_affine=False, eps=1e-6)
        self.mlp = MLP(h, shard_size(arch.ffn, tp, "FFN columns"), tanh_gelu=True)
        self.ada = nn.Linear(h // tp, 6 * h, bias=False)
        # adaLN-Zero: every block starts as the identity (``models.init`` zeroes it).
        self.ada.zero_init = True
        nn.init.zeros_(self.ada.weight)

    def forward(self, x: torch.Tensor, cond: torch.Tensor, context: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        c = F.silu(cond)
        if self.tp > 1:
            c = c.narrow(-1, 0, c.shape[-1] // self.tp)
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(c).unsqueeze(1).chunk(6, dim=-1)
        x = x + gate1 * self.attn(_modulate(self.norm1(x), shift1, scale1))
        x = x + self.cross(self.norm2(x), context, bias)
        return x + gate2 * self.mlp(_modulate(self.norm3(x), shift2, scale2))


class DiT(nn.Module):
    """``forward(latent [B, latent_channels, H, W], timesteps [B], context [B, M,
    context_dim], context_bias [B, 1, 1, M] or None) -> [B, latent_channels, H, W]``; H and
    W divisible by ``patch``; ``context_bias`` masks padded context rows."""

    def __init__(self, arch: ir.DiTArch, *, tp: int = 1):
        super().__init__()
        self.hidden, self.patch = arch.hidden, arch.patch
        self.latent_channels = arch.latent_channels
        patch_dim = arch.latent_channels * arch.patch ** 2
        self.patch_embed = nn.Linear(patch_dim, arch.hidden, bias=False)
        self.blocks = nn.ModuleDict({str(i): DiTBlock(arch, tp=tp) for i in range(arch.layers)})
        self.norm_out = nn.LayerNorm(arch.hidden, elementwise_affine=False, eps=1e-6)
        self.proj_out = nn.Linear(arch.hidden, patch_dim, bias=False)
        self.proj_out.zero_init = True
        nn.init.zeros_(self.proj_out.weight)

    def forward(self, latent: torch.Tensor, timesteps: torch.Tensor,
                context: torch.Tensor, context_bias: torch.Tensor | None = None
                ) -> torch.Tensor:
        x = self.embed(latent)
        x = self.run_blocks(x, self.timestep_code(timesteps, x.dtype), context, context_bias)
        return self.unembed(x, latent.shape)

    def embed(self, latent: torch.Tensor) -> torch.Tensor:
        """``[B, latent_channels, H, W]`` latents to ``[B, H W / patch^2, hidden]`` tokens:
        the patch embedding plus the fixed 2-D sin/cos position code (half the width per
        axis), as in DiT."""
        b, c, hgt, wid = latent.shape
        p = self.patch
        gh, gw = hgt // p, wid // p
        x = latent.reshape(b, c, gh, p, gw, p).permute(0, 2, 4, 1, 3, 5).reshape(
            b, gh * gw, c * p * p)
        x = self.patch_embed(x)
        rows = torch.arange(gh, device=x.device).repeat_interleave(gw)
        cols = torch.arange(gw, device=x.device).repeat(gh)
        half = self.hidden // 2
        pos = torch.cat([sinusoidal_embedding(rows, half),
                         sinusoidal_embedding(cols, self.hidden - half)], dim=-1)
        return x + pos.to(x.dtype)

    def timestep_code(self, timesteps: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``[B]`` timesteps to the ``[B, hidden]`` code every block's adaLN reads."""
        return sinusoidal_embedding(timesteps, self.hidden).to(dtype)

    def run_blocks(self, x: torch.Tensor, cond: torch.Tensor, context: torch.Tensor,
                   context_bias: torch.Tensor | None = None, start: int = 0,
                   stop: int | None = None) -> torch.Tensor:
        """Blocks ``start:stop`` (those this module holds) on tokens ``x``."""
        stop = len(self.blocks) if stop is None else stop
        for i in range(start, stop):
            x = self.blocks[str(i)](x, cond, context, context_bias)
        return x

    def unembed(self, x: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        """Tokens back to latents of ``shape`` ``[B, latent_channels, H, W]``: the final
        norm and projection, the patches put back in place."""
        b, c, hgt, wid = shape
        p = self.patch
        gh, gw = hgt // p, wid // p
        x = self.proj_out(self.norm_out(x))
        return x.reshape(b, gh, gw, c, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, c, hgt, wid)
