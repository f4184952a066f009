"""The projector between modules: an image encoder's optional token compression, then
``depth`` bias-free linear layers with the activation between them
(``flops.projector_params`` counts no biases).

Token compression (``ir.program.Compression``) runs on each image's patch grid, a group
``[B, rows * cols, width]`` of same-sized images at a time (``models.multimodal``), before
the MLP:

- ``pixel_shuffle(k)``: InternVL's ``pixel_shuffle`` (``ps_version='v2'``): each ``k x k``
  block of neighbouring patches concatenated on channels, in the block's row-major order,
  so the MLP reads ``k^2`` times the encoder's width on ``k^2`` times fewer tokens;
- ``avg_pool(k)``: LLaVA-OneVision's 2D average pooling of the grid (``avg_pool2d`` with
  kernel = stride = ``k``), in ceil mode (edge blocks average the patches they hold);
- ``resampler(queries=N)``: ``N`` learned queries cross-attend to the image's patches
  (Perceiver / Q-Former style, one pre-norm cross-attention with a residual on the
  queries, in the encoder's width): ``N`` tokens per image.

Tensor parallelism pairs the layers Megatron-style: even-numbered layers are
column-parallel (output divided by ``tp``), odd-numbered ones row-parallel (input
divided); with an odd depth the last layer is column-parallel and its output is
this rank's slice (the gather is left out, see ``transformer.py``). The compression is
replicated on every TP rank, as the projector is under the encoder's TP (``parallel.tp``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dtdsl.ir import program as ir
from dtdsl.models.ffn import activation

__all__ = ["AvgPool", "PixelShuffle", "Projector", "Resampler", "build_compression",
           "projector_tp_conflicts"]

def _widths(arch: ir.MLPArch) -> list[int]:
    return [arch.in_dim] + [arch.hidden] * (arch.depth - 1) + [arch.out_dim]


def projector_tp_conflicts(arch: ir.MLPArch, tp: int) -> tuple[str, ...]:
    """What tensor parallelism of degree ``tp`` cannot split evenly: the widths that
    column-parallel layers divide."""
    widths = _widths(arch)
    out = [f"a width of {widths[i + 1]}" for i in range(0, arch.depth, 2)
           if widths[i + 1] % tp]
    return tuple(dict.fromkeys(out))


def _grid(x: torch.Tensor, grid: tuple[int, int] | None) -> tuple[int, int]:
    """The patch grid of a group ``[B, N, width]``: ``grid``, or square when none is given
    (``(1, N)`` when ``N`` is not a square), as ``Encoder.embed`` assumes."""
    n = x.shape[1]
    if grid is None:
        side = math.isqrt(n)
        return (side, side) if side * side == n else (1, n)
    rows, cols = grid
    if rows * cols != n:
        raise ValueError(f"a patch grid of {rows} x {cols} for {n} tokens per image")
    return rows, cols


class PixelShuffle(nn.Module):
    """``[B, rows * cols, C]`` to ``[B, (rows / k) * (cols / k), C k^2]``."""

    def __init__(self, spec: ir.PixelShuffle):
        super().__init__()
        self.spec = spec

    def forward(self, x: torch.Tensor, grid: tuple[int, int] | None = None) -> torch.Tensor:
        rows, cols = _grid(x, grid)
        k = self.spec.factor
        self.spec.tokens(rows, cols)      # ValueError for a grid k does not divide
        b, _, c = x.shape
        x = x.reshape(b, rows // k, k, cols // k, k, c).permute(0, 1, 3, 2, 4, 5)
        return x.reshape(b, (rows // k) * (cols // k), k * k * c)


class AvgPool(nn.Module):
    """``[B, rows * cols, C]`` to ``[B, ceil(rows / k) * ceil(cols / k), C]``."""

    def __init__(self, spec: ir.AvgPool):
        super().__init__()
        self.spec = spec

    def forward(self, x: torch.Tensor, grid: tuple[int, int] | None = None) -> torch.Tensor:
        rows, cols = _grid(x, grid)
        k = self.spec.factor
        b, _, c = x.shape
        image = x.reshape(b, rows, cols, c).permute(0, 3, 1, 2)
        pooled = F.avg_pool2d(image, k, ceil_mode=True)
        return pooled.flatten(2).transpose(1, 2)


class Resampler(nn.Module):
    """``[B, N, C]`` to ``[B, queries, C]``: ``queries + wo(attention(wq(norm_q(queries)),
    wk(norm_kv(x)), wv(norm_kv(x))))`` with ``heads`` heads."""

    def __init__(self, spec: ir.Resampler, width: int):
        super().__init__()
        if width % spec.heads:
            raise ValueError(f"a resampler of {spec.heads} heads cannot split a width of "
                             f"{width}")
        self.heads = spec.heads
        self.queries = nn.Parameter(torch.empty(spec.queries, width))
        self.norm_q = nn.LayerNorm(width)
        self.norm_kv = nn.LayerNorm(width)
        self.wq = nn.Linear(width, width, bias=False)
        self.wk = nn.Linear(width, width, bias=False)
        self.wv = nn.Linear(width, width, bias=False)
        self.wo = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor, grid: tuple[int, int] | None = None) -> torch.Tensor:
        b, n, c = x.shape
        h, d = self.heads, c // self.heads
        queries = self.queries.to(x.dtype)
        q = self.wq(self.norm_q(queries)).view(1, -1, h, d).transpose(1, 2)
        kv = self.norm_kv(x)
        k = self.wk(kv).view(b, n, h, d).transpose(1, 2)
        v = self.wv(kv).view(b, n, h, d).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.expand(b, -1, -1, -1), k, v)
        return queries + self.wo(out.transpose(1, 2).reshape(b, -1, c))


def build_compression(spec: ir.Compression | None, width: int) -> nn.Module | None:
    """The module of a projector's compression on an encoder of ``width``, or None."""
    if spec is None:
        return None
    if isinstance(spec, ir.PixelShuffle):
        return PixelShuffle(spec)
    if isinstance(spec, ir.AvgPool):
        return AvgPool(spec)
    return Resampler(spec, width)


class Projector(nn.Module):
    """``forward(x [B, N, width], grid)`` (``grid``: the images' patch grid, for a
    compression) or ``forward(x [..., in_dim])`` without compression ``-> [..., out_dim]``
    (``out_dim / tp`` for an odd depth at ``tp > 1``)."""

    def __init__(self, arch: ir.MLPArch, *, tp: int = 1,
                 compress: ir.Compression | None = None):
        super().__init__()
        conflicts = projector_tp_conflicts(arch, tp)
        if conflicts:
            raise ValueError(f"tensor parallelism {tp} cannot split the projector's "
                             + ", ".join(conflicts))
        widths = _widths(arch)
        self.activation = activation(arch.activation)
        width = arch.in_dim
        if isinstance(compress, ir.PixelShuffle):
            width = arch.in_dim // compress.factor ** 2
        self.compress = build_compression(compress, width)
        layers = []
        for i in range(arch.depth):
            din, dout = widths[i], widths[i + 1]
            if i % 2 == 0:
                dout //= tp
            else:
                din //= tp
            layers.append(nn.Linear(din, dout, bias=False))
        self.layers = nn.ModuleList(layers)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP alone, on ``[..., in_dim]``."""
        for i, layer in enumerate(self.layers):
            if i:
                x = self.activation(x)
            x = layer(x)
        return x

    def forward(self, x: torch.Tensor, grid: tuple[int, int] | None = None) -> torch.Tensor:
        if self.compress is not None:
            x = self.compress(x, grid)
        return self.mlp(x)
