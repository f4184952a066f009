"""Torch modules built from the IR (``dtdsl.models`` re-exports them): a whole module, one
representative layer, a projector; with ``tp > 1`` the per-rank shard of Megatron-style
tensor parallelism (see the package docstring)."""

from __future__ import annotations

from torch import nn

from dtdsl.ir import program as ir
from dtdsl.models.dit import DiT, DiTBlock
from dtdsl.models.mlp import Projector
from dtdsl.models.transformer import Backbone, Encoder, TransformerLayer
from dtdsl.models.unet import UNet

__all__ = ["build_arch", "build_layer", "build_module", "build_projector", "tie_weights"]


def _check_tp(module: ir.Module, tp: int) -> None:
    if tp < 1:
        raise ValueError(f"tensor parallelism must be at least 1, not {tp}")
    conflicts = module.arch.tp_conflicts(tp)
    if conflicts:
        raise ValueError(f"tensor parallelism {tp} cannot split module '{module.name}': "
                         + ", ".join(conflicts))


def build_module(module: ir.Module, tp: int = 1) -> nn.Module:
    """The torch model of ``module`` (one TP rank's shard for ``tp > 1``).

    Encoders (transformer) -> ``Encoder``; the backbone -> ``Backbone``; generators ->
    ``UNet`` or ``DiT``. Raises ValueError for a role/architecture pair the runtime has
    no model for, or a ``tp`` the architecture cannot split."""
    _check_tp(module, tp)
    return build_arch(module.role, module.arch, tp, name=module.name)


def build_arch(role: str, arch: ir.Arch, tp: int = 1, *, name: str = "") -> nn.Module:
    """The torch model of a module of ``role`` with architecture ``arch`` (see
    ``build_module``); the model keeps ``arch`` and ``role`` as attributes (what
    ``models.hf.save_hf`` writes back)."""
    if isinstance(arch, ir.TransformerArch) and role == "encoder":
        model: nn.Module = Encoder(arch, tp=tp)
    elif isinstance(arch, ir.TransformerArch) and role == "backbone":
        model = Backbone(arch, tp=tp)
    elif isinstance(arch, ir.UNetArch) and role == "generator":
        model = UNet(arch, tp=tp)
    elif isinstance(arch, ir.DiTArch) and role == "generator":
        model = DiT(arch, tp=tp)
    else:
        raise ValueError(f"no runtime model for a {role} with a {arch.kind} architecture"
                         + (f" (module '{name}')" if name else ""))
    model.arch, model.role = arch, role
    return model


def tie_weights(module: nn.Module) -> None:
    """Tie every tied-embedding backbone in ``module`` again: ``to_empty`` (materialising a
    meta module) and tensor parallelism give each module its own new parameters."""
    for m in module.modules():
        if isinstance(m, Backbone):
            m.tie()


def build_layer(module: ir.Module, tp: int = 1) -> nn.Module:
    """One representative layer of a module made of identical layers: a
    ``TransformerLayer`` configured as the module's (norm, rotary, causal), or a
    ``DiTBlock``. A U-Net's blocks differ in width, so it has none (ValueError)."""
    _check_tp(module, tp)
    arch = module.arch
    if isinstance(arch, ir.TransformerArch):
        # An MoE backbone's representative layer is one of its MoE layers (the most work).
        moe = arch.moe if module.role == "backbone" else None
        layer = None if moe is None else moe.every - 1
        return TransformerLayer(arch, tp=tp, role=module.role, layer=layer)
    if isinstance(arch, ir.DiTArch):
        return DiTBlock(arch, tp=tp)
    raise ValueError(f"module '{module.name}' is a {arch.kind}, whose blocks differ in width; "
                     "build and time the whole module instead")


def build_projector(proj: ir.Projector, tp: int = 1) -> Projector:
    """The torch model of a projector (one TP rank's shard for ``tp > 1``)."""
    if tp < 1:
        raise ValueError(f"tensor parallelism must be at least 1, not {tp}")
    return Projector(proj.arch, tp=tp, compress=proj.compress)
