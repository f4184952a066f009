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

from dtdsl.models.build import build_arch, build_layer, build_module, build_projector, tie_weights
from dtdsl.models.dit import DiT, DiTBlock
from dtdsl.models.hf import load_hf, save_hf
from dtdsl.models.mlp import Projector, projector_tp_conflicts
from dtdsl.models.transformer import Backbone, Encoder, TransformerLayer
from dtdsl.models.unet import UNet

__all__ = [
    "Backbone", "DiT", "DiTBlock", "Encoder", "Projector", "TransformerLayer", "UNet",
    "build_arch", "build_layer", "build_module", "build_projector", "load_hf",
    "projector_tp_conflicts", "save_hf", "tie_weights",
]
