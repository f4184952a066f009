"""A Stable-Diffusion-2.x-style latent U-Net built from a ``UNetArch``.

It is built in exactly the order of ``dtdsl.cost.flops.unet_ops`` (conv_in, the
time embedding, residual blocks with GroupNorm, spatial transformers with linear
proj_in/proj_out, self-attention, cross-attention to the conditioning and a GEGLU
MLP, strided-conv downsampling, nearest upsampling + conv, skip concatenation),
so its parameter count is ``flops.module_params`` exactly (865,910,724 for SD 2.1).

Tensor parallelism (``tp``): the per-rank shard of a Megatron-style split, valid
where ``arch.tp_conflicts(tp)`` is empty. In a residual block the first conv and
the timestep projection are column-parallel (``cout / tp`` channels), the second
GroupNorm normalises the local ``groups / tp`` groups, and the second conv is
row-parallel back to ``cout``. Attention splits heads, the GEGLU MLP its width.
Layers whose input is replicated on every rank (the 1x1 skip conv, proj_in,
proj_out, down/upsampling convs) are row-parallel over a slice of their input
channels, so their work is divided too; conv_in, conv_out and the GroupNorms on
replicated inputs are replicated. The all-reduces after row-parallel layers are
left out (see ``transformer.py``): the shard computes one rank's share.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dtdsl.ir import program as ir
from dtdsl.models.transformer import (
    CrossAttention,
    SelfAttention,
    sinusoidal_embedding,
)

__all__ = ["UNet"]


def _local(x: torch.Tensor, tp: int) -> torch.Tensor:
    """Rank 0's slice of the channel dimension of a replicated input (a row-parallel
    layer's input): channels are dim 1 of images, the last dim of token tensors."""
    if tp == 1:
        return x
    dim = 1 if x.dim() == 4 else -1
    return x.narrow(dim, 0, x.shape[dim] // tp)


class _ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int, emb: int, groups: int, tp: int):
        super().__init__()
        self.tp = tp
        self.norm1 = nn.GroupNorm(groups, cin)
        self.conv1 = nn.Conv2d(cin, cout // tp, 3, padding=1)
        self.emb_proj = nn.Linear(emb, cout // tp)
        self.norm2 = nn.GroupNorm(groups // tp, cout // tp)
        self.conv2 = nn.Conv2d(cout // tp, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin // tp, cout, 1) if cin != cout else None

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.emb_proj(F.silu(emb))[:, :, None, None]
        h = self.conv2(F.silu(self.norm2(h)))
        return h + (x if self.skip is None else self.skip(_local(x, self.tp)))


class GEGLU(nn.Module):
    """The U-Net transformer block's MLP: a GELU-gated linear unit, ``out(value(x) *
    gelu(gate(x)))`` (diffusers fuses ``value`` and ``gate`` into one ``proj``; they are
    separate here so tensor parallelism cuts each by columns)."""

    def __init__(self, ch: int, tp: int):
        super().__init__()
        self.value = nn.Linear(ch, 4 * ch // tp)
        self.gate = nn.Linear(ch, 4 * ch // tp)
        self.out = nn.Linear(4 * ch // tp, ch)
        self.out.residual_out = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.value(x) * F.gelu(self.gate(x)))


class _TransformerBlock(nn.Module):
    def __init__(self, ch: int, arch: ir.UNetArch, tp: int):
        super().__init__()
        heads = ch // arch.head_dim // tp
        self.norm1 = nn.LayerNorm(ch)
        self.attn1 = SelfAttention(ch, heads, heads, arch.head_dim, out_bias=True)
        self.norm2 = nn.LayerNorm(ch)
        self.attn2 = CrossAttention(ch, arch.context_dim, heads, arch.head_dim, out_bias=True)
        self.norm3 = nn.LayerNorm(ch)
        self.ff = GEGLU(ch, tp)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        x = x + self.attn1(self.norm1(x))
        x = x + self.attn2(self.norm2(x), context)
        return x + self.ff(self.norm3(x))


class _SpatialTransformer(nn.Module):
    def __init__(self, ch: int, arch: ir.UNetArch, tp: int):
        super().__init__()
        self.tp = tp
        self.norm = nn.GroupNorm(arch.groups, ch, eps=1e-6)
        self.proj_in = nn.Linear(ch // tp, ch)
        self.blocks = nn.ModuleList(_TransformerBlock(ch, arch, tp)
                                    for _ in range(arch.transformer_depth))
        self.proj_out = nn.Linear(ch // tp, ch)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        b, c, hgt, wid = x.shape
        h = self.norm(x).flatten(2).transpose(1, 2)              # [B, HW, C]
        h = self.proj_in(_local(h, self.tp))
        for block in self.blocks:
            h = block(h, context)
        h = self.proj_out(_local(h, self.tp))
        return x + h.transpose(1, 2).reshape(b, c, hgt, wid)


class _Downsample(nn.Module):
    def __init__(self, ch: int, tp: int):
        super().__init__()
        self.tp = tp
        self.conv = nn.Conv2d(ch // tp, ch, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(_local(x, self.tp))


class _Upsample(nn.Module):
    def __init__(self, ch: int, tp: int):
        super().__init__()
        self.tp = tp
        self.conv = nn.Conv2d(ch // tp, ch, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(_local(x, self.tp), scale_factor=2.0, mode="nearest"))


class _Step(nn.ModuleList):
    """One entry of SD's input/middle/output block lists: layers applied in turn, each
    given what it needs (timestep embedding, conditioning)."""

    def forward(self, x: torch.Tensor, emb: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        for layer in self:
            if isinstance(layer, _ResBlock):
                x = layer(x, emb)
            elif isinstance(layer, _SpatialTransformer):
                x = layer(x, context)
            else:
                x = layer(x)
        return x


class UNet(nn.Module):
    """``forward(latent [B, latent_channels, H, W], timesteps [B], context [B, M,
    context_dim]) -> [B, latent_channels, H, W]`` (the predicted noise or velocity).
    H and W must be divisible by 2^(levels - 1); ``arch.latent`` is the size the cost
    model assumes."""

    def __init__(self, arch: ir.UNetArch, *, tp: int = 1):
        super().__init__()
        conflicts = arch.tp_conflicts(tp)
        if conflicts:
            raise ValueError(f"tensor parallelism {tp} cannot split the U-Net's "
                             + ", ".join(conflicts))
        for ch in arch.level_channels:
            if ch % arch.head_dim:
                raise ValueError(f"{ch} channels are not a whole number of "
                                 f"{arch.head_dim}-wide attention heads")
        c0 = arch.channels
        emb = 4 * c0
        self.model_channels = c0
        self.conv_in = nn.Conv2d(arch.latent_channels, c0, 3, padding=1)
        # Column- then row-parallel: the pair needs one all-reduce.
        self.time_embed = nn.Sequential(nn.Linear(c0, emb // tp), nn.SiLU(),
                                        nn.Linear(emb // tp, emb))
        levels = len(arch.mult)
        attention = set(arch.attention_levels)
        self.input_blocks = nn.ModuleList()
        skips = [c0]
        ch = c0
        for level, mult in enumerate(arch.mult):
            for _ in range(arch.res_blocks):
                step = _Step([_ResBlock(ch, c0 * mult, emb, arch.groups, tp)])
                ch = c0 * mult
                if level in attention:
                    step.append(_SpatialTransformer(ch, arch, tp))
                self.input_blocks.append(step)
                skips.append(ch)
            if level != levels - 1:
                self.input_blocks.append(_Step([_Downsample(ch, tp)]))
                skips.append(ch)
        self.middle_block = _Step([_ResBlock(ch, ch, emb, arch.groups, tp),
                                   _SpatialTransformer(ch, arch, tp),
                                   _ResBlock(ch, ch, emb, arch.groups, tp)])
        self.output_blocks = nn.ModuleList()
        for level in reversed(range(levels)):
            for i in range(arch.res_blocks + 1):
                cout = c0 * arch.mult[level]
                step = _Step([_ResBlock(ch + skips.pop(), cout, emb, arch.groups, tp)])
                ch = cout
                if level in attention:
                    step.append(_SpatialTransformer(ch, arch, tp))
                if level and i == arch.res_blocks:
                    step.append(_Upsample(ch, tp))
                self.output_blocks.append(step)
        self.norm_out = nn.GroupNorm(arch.groups, ch)
        self.conv_out = nn.Conv2d(ch, arch.latent_channels, 3, padding=1)

    def forward(self, latent: torch.Tensor, timesteps: torch.Tensor,
                context: torch.Tensor) -> torch.Tensor:
        t = sinusoidal_embedding(timesteps, self.model_channels).to(latent.dtype)
        emb = self.time_embed(t)
        h = self.conv_in(latent)
        hs = [h]
        for step in self.input_blocks:
            h = step(h, emb, context)
            hs.append(h)
        h = self.middle_block(h, emb, context)
        for step in self.output_blocks:
            h = step(torch.cat([h, hs.pop()], dim=1), emb, context)
        return self.conv_out(F.silu(self.norm_out(h)))
