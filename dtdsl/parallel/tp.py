"""Tensor parallelism for every unit (encoders, backbones, U-Net and DiT generators),
with DTensor's ``parallelize_module`` over the unit's TP mesh.

``parallelize_unit(module, tp_mesh)`` shards a unit in place (on the meta device, before
anything is materialised, or on real weights):

* every attention and MLP block (``SelfAttention``, ``CrossAttention``, ``MLP``, the
  U-Net's ``GEGLU``): the input projections (``wq``, ``wk``, ``wv``; ``w1``, ``w3``;
  ``value``, ``gate``) ``ColwiseParallel`` (``Shard(0)`` weights: a rank holds its heads or
  FFN columns), the output projections (``wo``, ``w2``, ``out``) ``RowwiseParallel``
  (``Shard(1)``; their partial sums are all-reduced, a bias stays ``Replicate`` and is added
  once). The projections are separate matrices, so each is a plain contiguous cut and a
  DCP checkpoint reshards between TP degrees by itself;
* a backbone runs with sequence parallelism (``_parallelize_backbone``): norms on this
  rank's piece of the sequence, attention and MLP gather it and reduce-scatter back; an
  MoE layer's block the same way (``parallelize_moe``: every expert's columns split, the
  router replicated; ``models.moe``, "Tensor parallelism");
* a backbone's token embedding is vocabulary-parallel (``RowwiseParallel`` on the embedding:
  a rank holds its rows of the vocabulary, ids it does not own embed to zero and the
  partial embeddings are all-reduced) and so is its LM head (``ColwiseParallel`` with
  ``Shard(-1)`` logits left as a DTensor): the cross-entropy runs under ``loss_parallel``
  (``backbone_output``), so no rank ever holds the full ``[tokens, vocab]`` logits;
* replicated: norms, the encoder's patch embedding, projectors, the U-Net's convolutions, a
  DiT's modulation and everything else outside the blocks.

So activations between blocks are the same on every TP rank (a backbone's: each rank its
piece of them), and the gradients of replicated parameters are too (a backbone's norm
weights: ``Partial`` sums that the optimizer reduces). The names of the parameters do not
change: a checkpoint key is the same under any TP degree.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import nn

from dtdsl.models.ffn import MLP
from dtdsl.models.transformer import Backbone, CrossAttention, SelfAttention

__all__ = ["enable_async_tp", "is_tp_sharded", "local_tensor", "parallelize_moe",
           "parallelize_unit", "tp_conflicts"]

_COL = ("wq", "wk", "wv", "w1", "w3", "value", "gate")
_ROW = ("wo", "w2", "out")


def enable_async_tp() -> None:
    """Async TP for the blocks compiled after this (``train.async_tp``), as torchtitan's
    ``maybe_enable_async_tp``: inductor's micro-pipelining pass rewrites each sequence-
    parallel all-gather before a matmul, and each reduce-scatter after one, into fused
    ops that move per-rank chunks over symmetric memory (set up for the group by the ops
    themselves: torch 2.13 needs no ``enable_symm_mem_for_group``), one chunk's transfer
    behind another's matmul (``cost.comm``). CUDA and NCCL only (the caller checks)."""
    import torch._inductor.config as inductor_config

    inductor_config._micro_pipeline_tp = True


def local_tensor(t: Any) -> Any:
    """The rank-local tensor of a DTensor (sharing its storage), or ``t`` itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _blocks(module: nn.Module) -> Iterator[tuple[str, nn.Module, list[tuple[str, int]]]]:
    """Every attention and MLP block with the counts a TP degree must divide."""
    from dtdsl.models.moe import MoE
    from dtdsl.models.unet import GEGLU

    moe = []        # an MoE block's shared expert is counted with the block
    for name, block in module.named_modules():
        if any(name.startswith(f"{m}.") or not m for m in moe):
            continue
        if isinstance(block, MoE):
            moe.append(name)
            cfg = block.config
            yield name, block, [("expert FFN columns", cfg.ffn)] + (
                [("shared expert columns", cfg.shared_ffn)] if cfg.shared_ffn else [])
        elif isinstance(block, SelfAttention):
            yield name, block, [("attention heads", block.wq.out_features // block.head_dim),
                                ("KV heads", block.wk.out_features // block.head_dim)]
        elif isinstance(block, CrossAttention):
            yield name, block, [("attention heads", block.wq.out_features // block.head_dim)]
        elif isinstance(block, MLP):
            yield name, block, [("FFN columns", block.w2.in_features)]
        elif isinstance(block, GEGLU):
            yield name, block, [("FFN columns", block.out.in_features)]


def tp_conflicts(module: nn.Module, tp: int) -> list[str]:
    """What TP degree ``tp`` cannot split evenly in ``module`` (empty when it can)."""
    out = []
    for name, _, counts in _blocks(module):
        for what, count in counts:
            if count % tp:
                out.append(f"{count} {what} ({name})")
    return out


def parallelize_unit(module: nn.Module, tp_mesh: Any) -> set[str]:
    """Shard ``module`` over ``tp_mesh`` in place (module docstring); the names of the
    parameters that are now sharded (the others are replicated on every TP rank).
    ValueError when the TP degree does not divide a block's heads or columns."""
    tp = tp_mesh.size()
    if tp == 1:
        return set()
    conflicts = tp_conflicts(module, tp)
    if conflicts:
        raise ValueError(f"tensor parallelism {tp} cannot split " + ", ".join(conflicts))
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    if isinstance(module, Backbone):
        _parallelize_backbone(module, tp_mesh)
        return {n for n, p in module.named_parameters() if is_tp_sharded(p)}
    found = False
    for _, block, _ in list(_blocks(module)):
        plan = {attr: ColwiseParallel() for attr in _COL if isinstance(getattr(block, attr,
                                                                             None), nn.Linear)}
        plan.update({attr: RowwiseParallel() for attr in _ROW
                     if isinstance(getattr(block, attr, None), nn.Linear)})
        parallelize_module(block, tp_mesh, plan)
        found = True
    if not found:
        raise NotImplementedError(f"{type(module).__name__}: tensor parallelism shards "
                                  "attention and MLP blocks, and it has none")
    return {n for n, p in module.named_parameters() if is_tp_sharded(p)}


def _parallelize_backbone(module: Backbone, tp_mesh: Any) -> None:
    """Megatron-style TP with sequence parallelism on a backbone (torchtitan's Llama plan):
    the residual stream between blocks is this rank's piece of the sequence ``[B, S / tp,
    hidden]``; norms run on it (``SequenceParallel``); attention and MLP gather the whole
    sequence at their input and reduce-scatter it at their output (``RowwiseParallel``
    to ``Shard(1)``). The embedding and the head are vocabulary parallel; the caller cuts
    the embedded sequence into pieces (``models.multimodal.scatter_sequence``) and
    gathers the final norm's output (``gather_sequence``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    for layer in module.layers.values():
        # QK-norm weights act on this rank's heads ([B, S, heads / tp, D], dimension 2
        # sharded): replicated, their gradients summed over TP (torchtitan's Qwen3 plan).
        norm_plan = {f"attn.{n}": SequenceParallel(sequence_dim=2, use_local_output=True)
                     for n in ("q_norm", "k_norm") if hasattr(layer.attn, n)}
        attn_plan = {
            **norm_plan,
            "attn_norm": SequenceParallel(use_local_output=True),
            "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                       desired_input_layouts=(Replicate(), None, None)),
            "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(),
            "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
            "mlp_norm": SequenceParallel(use_local_output=True)}
        if getattr(layer, "moe", False):    # the block gathers and scatters itself
            parallelize_module(layer, tp_mesh, attn_plan)
            parallelize_moe(layer.mlp, tp_mesh)
            continue
        mlp_plan = {f"mlp.{w}": ColwiseParallel() for w in ("w1", "w3")
                    if getattr(layer.mlp, w, None) is not None}
        parallelize_module(layer, tp_mesh, {
            **attn_plan,
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                      desired_input_layouts=(Replicate(),)),
            **mlp_plan,
            "mlp.w2": RowwiseParallel(output_layouts=Shard(1)),
        })
    plan: dict[str, Any] = {}
    if module.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(),
                                                 output_layouts=Replicate())
    if module.norm is not None:
        plan["norm"] = SequenceParallel(use_local_output=True)
    if module.output is not None:
        plan["output"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    if plan:
        parallelize_module(module, tp_mesh, plan)
    # parallelize_module gave the embedding and the head a DTensor each; tied embeddings
    # share one again (both Shard(0) over the vocabulary on the same mesh).
    module.tie()
    module.sp_mesh = tp_mesh


# An MoE block's parameters under TP: (owner path, attribute) -> the dimension split, None
# for replicated (``models.moe``, "Tensor parallelism").
_MOE_SPLITS = {("", "w1"): 1, ("", "w3"): 1, ("", "w2"): 2, ("router", "weight"): None,
               ("shared.w1", "weight"): 0, ("shared.w3", "weight"): 0,
               ("shared.w2", "weight"): 1, ("shared_gate", "weight"): None}


def parallelize_moe(block: nn.Module, tp_mesh: Any) -> None:
    """Shard MoE block ``block`` (``models.moe.MoE``, or expert parallelism's) over
    ``tp_mesh`` in place: each expert's ``w1``/``w3`` by columns, ``w2`` by rows, the
    shared expert likewise, the router and the shared expert's gate replicated, all as
    DTensors of their full tensors (made without a collective: on the meta device, or
    from the same values on every rank); the block then gathers the sequence and
    reduce-scatters its output itself (``MoE.tp_mesh``). The stacked experts go on
    ``block.experts_tp_mesh`` where the stage set one (expert parallelism)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    for (path, attr), dim in _MOE_SPLITS.items():
        owner = block
        for part in filter(None, path.split(".")):
            owner = getattr(owner, part, None)      # None: no shared expert, no gate
        param = getattr(owner, attr, None)
        if param is None:
            continue
        placement = Replicate() if dim is None else Shard(dim)
        mesh = tp_mesh
        if attr in ("w1", "w3", "w2") and not path and block.experts_tp_mesh is not None:
            mesh = block.experts_tp_mesh
        dt = distribute_tensor(param.detach(), mesh, [placement], src_data_rank=None)
        setattr(owner, attr, nn.Parameter(dt, requires_grad=param.requires_grad))
    block.tp_mesh = tp_mesh


def is_tp_sharded(param: Any) -> bool:
    """Whether a parameter is a DTensor with a ``Shard`` placement (as TP leaves it)."""
    placements = getattr(param, "placements", None)
    return placements is not None and any(pl.is_shard() for pl in placements)
