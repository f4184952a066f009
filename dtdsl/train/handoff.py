"""Tensors handed between units whose values the backward does not need, so that a
microbatch in flight does not hold them.

A stage keeps two kinds of tensors per microbatch between its forward and its backward
only for their place in the autograd graph:

- **What it sent** (``Handed``): an encoder's projected rows for the backbone, the
  backbone's conditioning for a generator. Their backward needs the gradient that comes
  back, not their values (the projector's last linear map kept its own input). The graph
  hangs off a zero-element ``proxy`` instead; the values live only until they are sent.
  (Megatron-LM frees its pipeline outputs the same way, ``deallocate_output_tensor``.)
- **What it received and differentiates** (``Sink``): the rows a backbone's first
  stage received from an encoder unit, spliced into its input. Every TP and CP rank
  receives them whole and keeps only its piece of the spliced sequence; their gradient is
  sent back, their values are not needed. The graph starts at ``tensor`` (the rows, used
  in the forward and then dropped) and the gradient lands in a ``Slot``.

At a 128K-token video sequence either is about 2 GB per microbatch in flight
(``dtc memcheck specs/mllm_72b_128k.dt``), which the cost model does not count as held.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dtdsl.ir.schedule import Action, ActionKind

__all__ = ["Handed", "PerPeer", "Sink", "Slot", "grad_of", "last_sends", "sinks"]


class Slot:
    """Where a tensor's gradient lands in backward (summed if it lands twice); the tensor's
    zeros when none came (``value``)."""

    __slots__ = ("device", "dtype", "grad", "shape")

    def __init__(self, like: torch.Tensor) -> None:
        self.grad: torch.Tensor | None = None
        self.shape, self.dtype, self.device = like.shape, like.dtype, like.device

    def value(self) -> torch.Tensor:
        """The gradient, or zeros of the tensor's shape when the backward never reached it."""
        if self.grad is not None:
            return self.grad
        return torch.zeros(self.shape, dtype=self.dtype, device=self.device)


class _Sink(torch.autograd.Function):
    """The identity on ``x`` (a view), whose backward puts the gradient in ``slot``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, anchor: torch.Tensor, slot: Slot) -> torch.Tensor:
        ctx.slot = slot
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, None, None]:
        slot = ctx.slot
        slot.grad = grad if slot.grad is None else slot.grad + grad
        return None, None, None


class Sink:
    """A received tensor ``x`` in the graph: ``tensor`` to compute with (a view of ``x``),
    its gradient in ``slot`` after the backward. Nothing in the graph keeps ``x``: once
    the caller drops ``tensor`` and ``x``, their memory is free."""

    __slots__ = ("slot", "tensor")

    def __init__(self, x: torch.Tensor) -> None:
        self.slot = Slot(x)
        # A leaf that wants a gradient, so that the backward reaches the sink at all.
        anchor = torch.empty(0, device=x.device, requires_grad=True)
        self.tensor = _Sink.apply(x, anchor, self.slot)


class _Proxy(torch.autograd.Function):
    """A zero-element tensor in ``y``'s graph: its backward gives ``y`` the gradient that
    ``slot`` holds (set just before the backward runs)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, slot: Slot) -> torch.Tensor:
        ctx.slot = slot
        return y.new_empty(0)

    @staticmethod
    def backward(ctx, _: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        grad, ctx.slot.grad = ctx.slot.grad, None
        return grad, None


class Handed:
    """A sent tensor ``y``'s place in the graph, without ``y``: ``seed(grad)`` gives the
    tensors and gradients ``torch.autograd.backward`` takes to differentiate through
    ``y`` as if it were still held."""

    __slots__ = ("proxy", "slot")

    def __init__(self, y: torch.Tensor) -> None:
        self.slot = Slot(y)
        self.proxy = _Proxy.apply(y, self.slot) if y.requires_grad else None

    @property
    def requires_grad(self) -> bool:
        return self.proxy is not None

    def seed(self, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(proxy, its gradient)`` for ``torch.autograd.backward``, with ``grad`` (of
        ``y``'s shape) waiting for ``y``."""
        if self.proxy is None:
            raise ValueError("the handed tensor needs no gradient")
        if tuple(grad.shape) != tuple(self.slot.shape):
            raise ValueError(f"a gradient of shape {tuple(grad.shape)} for a tensor of "
                             f"{tuple(self.slot.shape)}")
        self.slot.grad = grad
        return self.proxy, self.proxy.new_empty(0)


def sinks(rows: Mapping[str, Mapping[int, Any]]) -> tuple[dict, dict]:
    """Per peer, per sample: ``rows``' tensors to compute with and what keeps their
    gradients (a ``Sink``'s view and slot; a plain tensor, that needs no gradient, both)."""
    tensors = {p: {i: getattr(r, "tensor", r) for i, r in got.items()}
               for p, got in rows.items()}
    slots = {p: {i: getattr(r, "slot", r) for i, r in got.items()} for p, got in rows.items()}
    return tensors, slots


def last_sends(actions: Sequence[Action]) -> set[int]:
    """The index of each microbatch's (and chunk's) last ``SEND_F`` in ``actions``: after
    it, nothing reads what the forward sent."""
    last = {(a.chunk, a.microbatch): i for i, a in enumerate(actions)
            if a.kind is ActionKind.SEND_F}
    return set(last.values())


class PerPeer(dict):
    """Per producing unit (an encoder), its per-sample tensors: a backbone first stage's
    inputs and their gradients when several encoders feed it."""


def grad_of(x: Any) -> torch.Tensor:
    """The gradient the backward left for a stage input: a leaf's ``grad`` or a ``Slot``'s,
    zeros where none came."""
    if isinstance(x, Slot):
        return x.value()
    return x.grad if x.grad is not None else torch.zeros_like(x)
