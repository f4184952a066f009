"""Activation checkpointing of a stage's layers (as torchtitan's ``apply_ac`` beside
``apply_tp`` and ``apply_fsdp``): each layer of a unit that recomputes is wrapped in
torch's ``checkpoint_wrapper``, so its activations are recomputed in backward instead of
kept (``full``); or only each attention's core (``selective``, Megatron-LM's
``--recompute-granularity selective``): every ``SelfAttention`` and ``CrossAttention`` of
the unit runs its Q, K and V projections, rotary positions and scaled dot-product
attention under a non-reentrant checkpoint (``models.transformer.SelfAttention._core``),
keeping every other activation. DiT blocks and the U-Net's transformer blocks are
covered alike (their attention is the same modules). Full recomputation of a U-Net wraps
each residual block and each spatial transformer: the layers the cost model counts for it
(``ir.UNetArch.pipeline_layers``, a residual block with its attention), whose inputs it
keeps. Which mode a unit runs is the spec's (``recompute = ...``) or the plan's
(``UnitPlan.recompute``) decision: ``train.stage`` says."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from torch import nn

from dtdsl.ir.program import Recompute
from dtdsl.models.transformer import CrossAttention, SelfAttention
from dtdsl.models.unet import ResnetBlock, SpatialTransformer, UNet
from dtdsl.parallel.fsdp import stage_layers

__all__ = ["apply_ac", "recompute_layers"]


def recompute_layers(units: Mapping[str, nn.Module]) -> Iterator[tuple[str, str, nn.Module]]:
    """(unit, prefix in the unit, module) of what full recomputation wraps: the layers
    FSDP2 shards (``stage_layers``) and, in a U-Net, every residual block and spatial
    transformer of its down, middle and up blocks."""
    yield from stage_layers(units)
    for name, unit in units.items():
        for at, net in unit.named_modules():
            if isinstance(net, UNet):
                for prefix, sub in net.named_modules():
                    if isinstance(sub, (ResnetBlock, SpatialTransformer)):
                        yield name, f"{at}.{prefix}" if at else prefix, sub


def apply_ac(units: Mapping[str, nn.Module],
             recomputes: Callable[[str], Recompute | bool]) -> None:
    """Recompute the layers (``parallel.fsdp.stage_layers``) of each unit of ``units`` as
    ``recomputes(unit name)`` says (``Recompute.of``: a bool is full or none), in place.
    Full: each layer wrapped in ``checkpoint_wrapper`` (the wrapper takes the layer's place
    in its parent, so parameter names gain the wrapper's prefix, which checkpoints strip).
    Selective: each attention of the unit checkpoints its core (``recompute_core``);
    parameter names do not change."""
    for unit_name, unit in units.items():
        if Recompute.of(recomputes(unit_name)) is Recompute.SELECTIVE:
            for sub in unit.modules():
                if isinstance(sub, (SelfAttention, CrossAttention)):
                    sub.recompute_core = True
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for unit_name, prefix, layer in list(recompute_layers(units)):
        if Recompute.of(recomputes(unit_name)) is Recompute.FULL:
            parent_name, _, child = prefix.rpartition(".")
            parent = units[unit_name].get_submodule(parent_name)
            parent.register_module(child, checkpoint_wrapper(layer))
