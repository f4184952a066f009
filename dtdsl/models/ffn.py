"""The feed-forward block every transformer uses (``MLP``: SwiGLU or plain, the MoE's shared
expert too) and the activations, by name, of blocks and projectors."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MLP", "activation"]


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "gelu": F.gelu, "gelu_tanh": _gelu_tanh, "quick_gelu": _quick_gelu,
    "relu": F.relu}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation function called ``name`` (``ir.TransformerArch.activation``,
    ``ir.MLPArch.activation``)."""
    return _ACTIVATIONS[name]


class MLP(nn.Module):
    """The feed-forward block; ``ffn`` is this rank's width. Gated (SwiGLU as Llama:
    ``w2(act(w1 x) * w3 x)``) or plain (``w2(act(w1 x))``), ``act`` by name
    (``activation``); ``tanh_gelu`` is DiT's shorthand for ``act="gelu_tanh"``."""

    def __init__(self, dim: int, ffn: int, *, swiglu: bool = False, tanh_gelu: bool = False,
                 act: str | None = None, bias: bool = False):
        super().__init__()
        name = act or ("silu" if swiglu else "gelu_tanh" if tanh_gelu else "gelu")
        self.act = activation(name)
        self.w1 = nn.Linear(dim, ffn, bias=bias)
        self.w3 = nn.Linear(dim, ffn, bias=bias) if swiglu else None
        self.w2 = nn.Linear(ffn, dim, bias=bias)
        self.w2.residual_out = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:
            return self.w2(self.act(self.w1(x)) * self.w3(x))
        return self.w2(self.act(self.w1(x)))
