"""Torch modules built from the IR: the models the distributed runtime trains.

``build_module`` and ``build_projector`` give a whole module or projector;
``build_layer`` one representative layer (for per-layer profiling). With
``tp > 1`` each builds the per-rank shard of Megatron-style tensor parallelism,
without the collectives (see ``transformer.py``): timing a shard on one device
gives one rank's compute in a TP group of ``tp`` ranks.

Parameter counts at ``tp = 1`` equal ``dtdsl.cost.flops.module_params`` and
``projector_params``, except for a backbone's norms (RMSNorm has no bias: ``layers
* 2 * hidden - hidden`` fewer; see ``transformer.py``).

Build on the meta device to count parameters of a large model for free::

    with torch.device("meta"):
        model = build_module(program.backbone)

Hugging Face models in and out (``models.hf``): ``load_hf(DIR)`` returns dtdsl's module for a
Hugging Face directory, weights loaded; ``save_hf(module, DIR)`` writes one back.
"""

from __future__ import annotations

from torch import nn

from dtdsl.ir import program as ir
from dtdsl.models.dit import DiT, DiTBlock
from dtdsl.models.mlp import Projector, projector_tp_conflicts
from dtdsl.models.transformer import Backbone, Encoder, TransformerLayer
from dtdsl.models.unet import UNet

__all__ = [
    "Backbone", "DiT", "DiTBlock", "Encoder", "Projector", "TransformerLayer", "UNet",
    "build_arch", "build_layer", "build_module", "build_projector", "load_hf",
    "projector_tp_conflicts", "save_hf", "tie_weights",
]


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


from dtdsl.models.hf import load_hf, save_hf  # noqa: E402 - after what models.hf builds with
