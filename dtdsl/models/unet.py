"""A Stable-Diffusion latent U-Net built from a ``UNetArch``: diffusers'
``UNet2DConditionModel`` of SD 1.x/2.x, module for module.

The module tree is diffusers': ``conv_in``, ``time_embedding`` (``linear_1``, SiLU,
``linear_2`` over the sinusoidal timestep code, cosines first), ``down_blocks`` (residual
blocks, spatial transformers at the levels with attention, a strided-conv downsampler
but at the deepest level), ``mid_block`` (residual, transformer, residual), ``up_blocks``
(deepest first: residual blocks over the concatenated skips, transformers, a nearest x2
upsampler and conv but at the shallowest level), ``conv_norm_out``, SiLU, ``conv_out``. The
residual blocks' GroupNorms use ``norm_eps``, the transformers' GroupNorm 1e-6 and their
LayerNorms 1e-5, as diffusers builds them. Each level's attention has the architecture's
head count (SD 1.x: 8 heads everywhere; SD 2.x: 64-wide heads), the middle block the
deepest level's.

Three things are kept in a form that is the same computation but cuts or maps better:

- a spatial transformer's ``proj_in``/``proj_out`` are linear layers on the flattened
  pixels whether the checkpoint has linear layers (SD 2.x) or 1x1 convolutions (SD 1.x):
  the same numbers (``models.hf`` reshapes the weights);
- attention projections are ``wq``, ``wk``, ``wv``, ``wo`` (diffusers' ``to_q`` ... ``to_out.0``);
- the GEGLU's fused ``proj`` (its first half the value, its second the gate) is two
  matrices, ``value`` and ``gate``, so tensor parallelism cuts each by columns.

It is built in exactly the order of ``dtdsl.cost.flops.unet_ops``, so its parameter count
is ``flops.module_params`` exactly (865,910,724 for SD 2.1).

Tensor parallelism (``tp``): the per-rank shard of what the runtime shards (``parallel.tp``):
each attention's heads and each GEGLU's width are divided by ``tp``; convolutions, norms,
the projections around the transformers and the time embedding are replicated. The
all-reduces after the row-parallel ``wo`` and ``out`` are left out (see ``transformer.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dtdsl.ir import program as ir
from dtdsl.models.transformer import CrossAttention, SelfAttention, shard_size, sinusoidal_embedding

__all__ = ["GEGLU", "UNet"]


class ResnetBlock(nn.Module):
    """diffusers' ``ResnetBlock2D`` (the default time-embedding form)."""

    def __init__(self, cin: int, cout: int, emb: int, groups: int, eps: float):
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, cin, eps=eps)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.time_emb_proj = nn.Linear(emb, cout)
        self.norm2 = nn.GroupNorm(groups, cout, eps=eps)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.conv_shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else None

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.time_emb_proj(F.silu(emb))[:, :, None, None]
        h = self.conv2(F.silu(self.norm2(h)))
        return h + (x if self.conv_shortcut is None else self.conv_shortcut(x))


class GEGLU(nn.Module):
    """The transformer block's MLP: a GELU-gated linear unit, ``out(value(x) *
    gelu(gate(x)))``; ``inner`` is this rank's width."""

    def __init__(self, ch: int, inner: int):
        super().__init__()
        self.value = nn.Linear(ch, inner)
        self.gate = nn.Linear(ch, inner)
        self.out = nn.Linear(inner, ch)
        self.out.residual_out = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.value(x) * F.gelu(self.gate(x)))


class TransformerBlock(nn.Module):
    """diffusers' ``BasicTransformerBlock``: self-attention, cross-attention to the
    conditioning, GEGLU, each after a LayerNorm and added to the residual."""

    def __init__(self, ch: int, heads: int, context_dim: int, tp: int):
        super().__init__()
        head_dim = ch // heads
        local = shard_size(heads, tp, "attention heads")
        self.norm1 = nn.LayerNorm(ch)
        self.attn1 = SelfAttention(ch, local, local, head_dim, out_bias=True)
        self.norm2 = nn.LayerNorm(ch)
        self.attn2 = CrossAttention(ch, context_dim, local, head_dim, out_bias=True)
        self.norm3 = nn.LayerNorm(ch)
        self.ff = GEGLU(ch, shard_size(4 * ch, tp, "GEGLU columns"))

    def forward(self, x: torch.Tensor, context: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn1(self.norm1(x))
        x = x + self.attn2(self.norm2(x), context, bias)
        return x + self.ff(self.norm3(x))


class SpatialTransformer(nn.Module):
    """diffusers' ``Transformer2DModel`` on a feature map ``[B, C, H, W]``."""

    def __init__(self, ch: int, heads: int, arch: ir.UNetArch, tp: int):
        super().__init__()
        self.norm = nn.GroupNorm(arch.groups, ch, eps=1e-6)
        self.proj_in = nn.Linear(ch, ch)
        self.transformer_blocks = nn.ModuleList(
            TransformerBlock(ch, heads, arch.context_dim, tp)
            for _ in range(arch.transformer_depth))
        self.proj_out = nn.Linear(ch, ch)

    def forward(self, x: torch.Tensor, context: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        b, c, hgt, wid = x.shape
        h = self.proj_in(self.norm(x).permute(0, 2, 3, 1).reshape(b, hgt * wid, c))
        for block in self.transformer_blocks:
            h = block(h, context, bias)
        h = self.proj_out(h)
        return x + h.reshape(b, hgt, wid, c).permute(0, 3, 1, 2)


class Downsample(nn.Module):
    def __init__(self, ch: int):
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class Upsample(nn.Module):
    def __init__(self, ch: int):
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class _Block(nn.Module):
    """A down or up block: residual blocks, each followed by its spatial transformer when
    the level has attention, then the resampler (if any)."""

    def __init__(self) -> None:
        super().__init__()
        self.resnets = nn.ModuleList()
        self.attentions = nn.ModuleList()

    def pairs(self):
        attentions = list(self.attentions) or [None] * len(self.resnets)
        return zip(self.resnets, attentions, strict=True)


class DownBlock(_Block):
    def __init__(self) -> None:
        super().__init__()
        self.downsamplers = nn.ModuleList()

    def forward(self, x: torch.Tensor, emb: torch.Tensor, context: torch.Tensor,
                bias: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        skips = []
        for resnet, attention in self.pairs():
            x = resnet(x, emb)
            if attention is not None:
                x = attention(x, context, bias)
            skips.append(x)
        for down in self.downsamplers:
            x = down(x)
            skips.append(x)
        return x, skips


class UpBlock(_Block):
    def __init__(self) -> None:
        super().__init__()
        self.upsamplers = nn.ModuleList()

    def forward(self, x: torch.Tensor, skips: list[torch.Tensor], emb: torch.Tensor,
                context: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        for resnet, attention in self.pairs():
            x = resnet(torch.cat([x, skips.pop()], dim=1), emb)
            if attention is not None:
                x = attention(x, context, bias)
        for up in self.upsamplers:
            x = up(x)
        return x


class MidBlock(_Block):
    def forward(self, x: torch.Tensor, emb: torch.Tensor, context: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        x = self.resnets[0](x, emb)
        for attention, resnet in zip(self.attentions, self.resnets[1:], strict=True):
            x = resnet(attention(x, context, bias), emb)
        return x


class TimestepEmbedding(nn.Module):
    def __init__(self, cin: int, emb: int):
        super().__init__()
        self.linear_1 = nn.Linear(cin, emb)
        self.linear_2 = nn.Linear(emb, emb)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(t)))


class UNet(nn.Module):
    """``forward(latent [B, latent_channels, H, W], timesteps [B], context [B, M,
    context_dim], context_bias [B, 1, 1, M] or None) -> [B, latent_channels, H, W]`` (the
    predicted noise or velocity; ``context_bias`` masks padded context rows).
    H and W must be divisible by 2^(levels - 1); ``arch.latent`` is the size the cost
    model assumes."""

    def __init__(self, arch: ir.UNetArch, *, tp: int = 1):
        super().__init__()
        conflicts = arch.tp_conflicts(tp)
        if conflicts:
            raise ValueError(f"tensor parallelism {tp} cannot split the U-Net's "
                             + ", ".join(conflicts))
        for level in (*arch.attention_levels, len(arch.mult) - 1):
            ch, heads = arch.level_channels[level], arch.level_heads(level)
            if heads < 1 or ch % heads:
                raise ValueError(f"{ch} channels at level {level} are not a whole number of "
                                 f"{heads} attention heads")
        c0 = arch.channels
        emb = 4 * c0
        eps, groups = arch.norm_eps, arch.groups
        self.model_channels = c0
        self.conv_in = nn.Conv2d(arch.latent_channels, c0, 3, padding=1)
        self.time_embedding = TimestepEmbedding(c0, emb)
        levels = len(arch.mult)
        attention = set(arch.attention_levels)

        def transformer(ch: int, level: int) -> SpatialTransformer:
            return SpatialTransformer(ch, arch.level_heads(level), arch, tp)

        self.down_blocks = nn.ModuleList()
        skips = [c0]
        ch = c0
        for level, mult in enumerate(arch.mult):
            block = DownBlock()
            for _ in range(arch.res_blocks):
                block.resnets.append(ResnetBlock(ch, c0 * mult, emb, groups, eps))
                ch = c0 * mult
                if level in attention:
                    block.attentions.append(transformer(ch, level))
                skips.append(ch)
            if level != levels - 1:
                block.downsamplers.append(Downsample(ch))
                skips.append(ch)
            self.down_blocks.append(block)
        self.mid_block = MidBlock()
        self.mid_block.resnets.append(ResnetBlock(ch, ch, emb, groups, eps))
        self.mid_block.attentions.append(transformer(ch, levels - 1))
        self.mid_block.resnets.append(ResnetBlock(ch, ch, emb, groups, eps))
        self.up_blocks = nn.ModuleList()
        for level in reversed(range(levels)):
            block = UpBlock()
            cout = c0 * arch.mult[level]
            for _ in range(arch.res_blocks + 1):
                block.resnets.append(ResnetBlock(ch + skips.pop(), cout, emb, groups, eps))
                ch = cout
                if level in attention:
                    block.attentions.append(transformer(ch, level))
            if level:
                block.upsamplers.append(Upsample(ch))
            self.up_blocks.append(block)
        self.conv_norm_out = nn.GroupNorm(groups, ch, eps=eps)
        self.conv_out = nn.Conv2d(ch, arch.latent_channels, 3, padding=1)

    def forward(self, latent: torch.Tensor, timesteps: torch.Tensor,
                context: torch.Tensor, context_bias: torch.Tensor | None = None
                ) -> torch.Tensor:
        t = sinusoidal_embedding(timesteps, self.model_channels).to(latent.dtype)
        emb = self.time_embedding(t)
        h = self.conv_in(latent)
        skips = [h]
        for block in self.down_blocks:
            h, more = block(h, emb, context, context_bias)
            skips.extend(more)
        h = self.mid_block(h, emb, context, context_bias)
        for block in self.up_blocks:
            h = block(h, skips, emb, context, context_bias)
        return self.conv_out(F.silu(self.conv_norm_out(h)))
