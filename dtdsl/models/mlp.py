"""The projector between modules: ``depth`` bias-free linear layers with the
activation between them (``flops.projector_params`` counts no biases).

Tensor parallelism pairs the layers Megatron-style: even-numbered layers are
column-parallel (output divided by ``tp``), odd-numbered ones row-parallel (input
divided); with an odd depth the last layer is column-parallel and its output is
this rank's slice (the gather is left out, see ``transformer.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dtdsl.ir import program as ir

__all__ = ["Projector", "projector_tp_conflicts"]

_ACTIVATIONS = {"gelu": F.gelu, "silu": F.silu, "relu": F.relu}


def _widths(arch: ir.MLPArch) -> list[int]:
    return [arch.in_dim] + [arch.hidden] * (arch.depth - 1) + [arch.out_dim]


def projector_tp_conflicts(arch: ir.MLPArch, tp: int) -> tuple[str, ...]:
    """What tensor parallelism of degree ``tp`` cannot split evenly: the widths that
    column-parallel layers divide."""
    widths = _widths(arch)
    out = [f"a width of {widths[i + 1]}" for i in range(0, arch.depth, 2)
           if widths[i + 1] % tp]
    return tuple(dict.fromkeys(out))


class Projector(nn.Module):
    """``forward(x [..., in_dim]) -> [..., out_dim]`` (``out_dim / tp`` for an odd
    depth at ``tp > 1``)."""

    def __init__(self, arch: ir.MLPArch, *, tp: int = 1):
        super().__init__()
        conflicts = projector_tp_conflicts(arch, tp)
        if conflicts:
            raise ValueError(f"tensor parallelism {tp} cannot split the projector's "
                             + ", ".join(conflicts))
        widths = _widths(arch)
        self.activation = _ACTIVATIONS[arch.activation]
        layers = []
        for i in range(arch.depth):
            din, dout = widths[i], widths[i + 1]
            if i % 2 == 0:
                dout //= tp
            else:
                din //= tp
            layers.append(nn.Linear(din, dout, bias=False))
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if i:
                x = self.activation(x)
            x = layer(x)
        return x
