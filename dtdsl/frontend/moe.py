"""Mixture-of-experts arguments of ``transformer(...)``: ``experts=E, top_k=K`` and the rest.

``arch = transformer(..., experts=64, top_k=8, expert_ffn=768)`` makes a backbone's MLPs
mixtures of experts (``ir.program.MoEArch``, run by ``models.moe``). The names follow
transformers' Qwen3-MoE / Mixtral configs where they can: ``experts`` is
``num_experts`` (``num_local_experts``), ``top_k`` ``num_experts_per_tok``, ``expert_ffn``
``moe_intermediate_size``, ``moe_every`` ``decoder_sparse_step``, ``aux_loss``
``router_aux_loss_coef`` and ``norm_topk`` ``norm_topk_prob``. ``shared_experts=S`` adds
an always-on shared expert of ``S x expert_ffn`` columns (DeepSeek's ``n_shared_experts``),
``capacity=C`` a capacity factor (dropless without it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dtdsl.codes import DT640, DT641, DT642
from dtdsl.frontend import ast
from dtdsl.frontend.schema import BoolKind, Ctx, FloatKind, IntKind, Param
from dtdsl.ir.program import MoEArch

__all__ = ["DEFAULT_AUX_LOSS", "DEFAULT_TOP_K", "MOE_ARGS", "resolve_moe"]

# transformers' MixtralConfig and Qwen3MoeConfig: router_aux_loss_coef = 0.001, and
# Mixtral's num_experts_per_tok = 2.
DEFAULT_AUX_LOSS = 0.001
DEFAULT_TOP_K = 2

MOE_ARGS = (
    Param("experts", IntKind(1, 4096), doc="experts=64"),
    Param("top_k", IntKind(1, 4096), doc="top_k=8"),
    Param("expert_ffn", IntKind(1, 1 << 20), doc="expert_ffn=768"),
    Param("shared_experts", IntKind(0, 64), doc="shared_experts=1"),
    Param("capacity", FloatKind(0.0, 64.0, low_exclusive=True), doc="capacity=1.25"),
    Param("moe_every", IntKind(1, 1024), doc="moe_every=2"),
    Param("aux_loss", FloatKind(0.0, 100.0), doc="aux_loss=0.001"),
    Param("norm_topk", BoolKind()),
)
_NAMES = tuple(p.name for p in MOE_ARGS)


def resolve_moe(call: ast.Call, role: str, name: str, layers: int, ffn: int,
                args: Mapping[str, Any], ctx: Ctx) -> MoEArch | None | Any:
    """The ``MoEArch`` a transformer's arguments ask for, None for a dense one, or INVALID
    after reporting why not: MoE arguments without ``experts`` or off the backbone (DT640),
    ``top_k`` above ``experts`` (DT641), ``moe_every`` above the layers (DT642)."""
    given = [n for n in _NAMES if args.get(n) is not None]
    if not given:
        return None
    if args.get("experts") is None:
        return ctx.error(DT640, f"{', '.join(given)} of {role} {name} describe a mixture of "
                         "experts, but it has no experts=", call.arg_span(given[0]),
                         hint="add experts=E (e.g. experts=8, top_k=2), or remove "
                              f"{', '.join(given)}")
    if role != "backbone":
        return ctx.error(DT640, f"{role} {name} has experts, and only the backbone can be a "
                         "mixture of experts", call.arg_span("experts"),
                         notes=["the runtime's MoE block replaces the backbone's MLP "
                                "(dtdsl.models.moe)"],
                         hint="remove the MoE arguments from this module")
    experts = args["experts"]
    top_k = args.get("top_k") or min(DEFAULT_TOP_K, experts)
    if top_k > experts:
        return ctx.error(DT641, f"top_k={top_k} routes each token to {top_k} experts, but "
                         f"there are only {experts} experts", call.arg_span("top_k"),
                         hint=f"use top_k <= {experts}, or more experts")
    every = args.get("moe_every") or 1
    if every > layers:
        return ctx.error(DT642, f"moe_every={every} makes every {every}th layer an MoE "
                         f"layer, but {name} has only {layers} layers: none would hold "
                         "experts", call.arg_span("moe_every"),
                         hint=f"use moe_every <= {layers} (1: every layer)")
    expert_ffn = args.get("expert_ffn") or ffn
    shared = args.get("shared_experts") or 0
    aux = args.get("aux_loss")
    norm = args.get("norm_topk")
    return MoEArch(experts=experts, top_k=top_k, ffn=expert_ffn, shared_ffn=shared * expert_ffn,
                   norm_topk=True if norm is None else norm,
                   capacity_factor=args.get("capacity"), every=every,
                   aux_loss_coef=DEFAULT_AUX_LOSS if aux is None else aux)
