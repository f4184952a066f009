"""Activation checkpointing of a stage's layers (as torchtitan's ``apply_ac`` beside
``apply_tp`` and ``apply_fsdp``): each layer of a unit that recomputes is wrapped in
torch's ``checkpoint_wrapper``, so its activations are recomputed in backward instead of
kept. Which units recompute is the spec's (``recompute = true``) or the plan's
(``UnitPlan.recompute``) decision: ``train.stage`` says."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from torch import nn

from dtdsl.parallel.fsdp import stage_layers

__all__ = ["apply_ac"]


def apply_ac(units: Mapping[str, nn.Module], recomputes: Callable[[str], bool]) -> None:
    """Wrap every layer (``parallel.fsdp.stage_layers``) of each unit of ``units`` for
    which ``recomputes(unit name)`` holds in ``checkpoint_wrapper``, in place (the
    wrapper takes the layer's place in its parent, so parameter names gain the wrapper's
    prefix, which checkpoints strip)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for unit_name, prefix, layer in list(stage_layers(units)):
        if recomputes(unit_name):
            parent_name, _, child = prefix.rpartition(".")
            parent = units[unit_name].get_submodule(parent_name)
            parent.register_module(child, checkpoint_wrapper(layer))
