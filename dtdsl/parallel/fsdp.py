"""FSDP2 for a stage: which modules become units, how they are sharded, and what of FSDP2's
state the runtime reads (as torchtitan's ``apply_fsdp`` beside ``apply_tp``).

``apply_fsdp(stage, units, mesh, compute_dtype)`` makes every layer of ``units`` (encoder
and backbone layers, a DiT's blocks: ``stage_layers``) an FSDP2 unit over ``mesh`` and
``stage`` the root, with the spec's ``MixedPrecisionPolicy`` (compute-dtype parameters,
fp32 master weights and gradient reduction), each unit kept gathered after its forward
(``reshard_after_forward=False``: ZeRO-1, ``train.stage``), gradients summed rather than
averaged (``sum_gradients``). On a DP mesh of one rank there is nothing to shard, gather
early or reduce behind the backward, and a unit per layer only costs host time (FSDP2's
hooks around every layer of every microbatch left a host-bound step 17% behind a plain
loop on an H200, ``benchmarks/step_vs_torch.py``): the stage is then the one unit, and
each layer casts its floating-point inputs to the compute dtype (``cast_inputs``) as a
unit of its own would.

The rest reads FSDP2's per-parameter state, for what its API does not expose: which
gradients wait for reduction (``has_grad``), which are left unequal over TP
(``tp_unreduced``), and zeros in the reduce dtype for unused parameters
(``zero_unused_in_reduce_dtype``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from dtdsl.parallel.mesh import data_parallel_mesh

__all__ = ["accumulate_unsharded", "apply_fsdp", "cast_inputs", "has_grad", "param_groups",
           "reduce_alone", "replica_mesh", "stage_layers", "sum_gradients", "tp_unreduced",
           "zero_unused_in_reduce_dtype"]


def stage_layers(units: Mapping[str, nn.Module]) -> Iterator[tuple[str, str, nn.Module]]:
    """(unit, prefix in the unit, module) of each layer of ``units`` (a stage's units by
    name, in forward order): encoder and backbone layers, a DiT's blocks. What FSDP2 makes
    a unit of its own and activation checkpointing wraps (``parallel.recompute``)."""
    for name, unit in units.items():
        layers = getattr(unit, "layers", None)
        if isinstance(layers, nn.ModuleDict):
            for key, layer in layers.items():
                yield name, f"layers.{key}", layer
        blocks = getattr(unit, "blocks", None)
        if isinstance(blocks, nn.ModuleDict) and not isinstance(layers, nn.ModuleDict):
            for key, block in blocks.items():     # a DiT's, by index (a stage's share)
                yield name, f"blocks.{key}", block


def replica_mesh(mesh: Any, *, local_sgd: bool) -> Any:
    """What FSDP2 shards and reduces over: the DP mesh (``data_parallel_mesh``), or under
    Local SGD (``train.sync``) one replica's ranks only, ``dp_shard`` of the ZeRO-0 layout
    (``ir.Train.mesh_zero``: one rank), so no gradient crosses replicas; the replicas meet
    in ``train.local_sgd`` every ``period`` steps instead."""
    return mesh["dp_shard"] if local_sgd else data_parallel_mesh(mesh)


def apply_fsdp(stage: nn.Module, units: Mapping[str, nn.Module], mesh: Any,
               compute_dtype: torch.dtype, *, experts: Any = None) -> list[nn.Module]:
    """FSDP2 over ``mesh`` (module docstring): every layer of ``units`` a unit of its own
    (none on a mesh of one rank), ``stage`` the root; the layer units, in forward order.
    The root casts no input: a generator's targets (its noise and clean latents) stay
    fp32 for the loss; the stage's forward casts what its modules read.

    ``experts``: under expert parallelism, what the experts shard and reduce over: the
    expert DP group (``parallel.mesh``, ``ExpertGroups.mesh`` as ``replica_mesh`` takes
    it: under Local SGD the replica's own ranks holding them). Each expert-parallel
    block's stacked experts (``parallel.ep.EXPERT_PARAMS``), which differ between the
    ranks of its EP group, are then left out of their layer's unit and make a unit of
    their own over that mesh (the
    block, its replicated router and shared expert ignored there, left to the layer),
    listed after its layer: FSDP2 shards and reduces them over the ranks holding the same
    experts only."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from dtdsl.parallel.ep import EXPERT_PARAMS, expert_blocks

    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    layers = []
    for _, _, layer in list(stage_layers(units)):
        if mesh.size() == 1:
            cast_inputs(layer, compute_dtype)
            continue
        blocks = expert_blocks(layer) if experts is not None else []
        ignored = {getattr(b, n) for b in blocks for n in EXPERT_PARAMS}
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=False,
                    ignored_params=ignored or None)
        sum_gradients(layer)
        layers.append(layer)
        for block in blocks:
            shared = {p for n, p in block.named_parameters() if n not in EXPERT_PARAMS}
            fully_shard(block, mesh=experts, mp_policy=mp,
                        reshard_after_forward=False, ignored_params=shared or None)
            sum_gradients(block)
            layers.append(block)
    root_mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32,
                                   cast_forward_inputs=False)
    fully_shard(stage, mesh=mesh, mp_policy=root_mp, reshard_after_forward=False)
    sum_gradients(stage)
    return layers


def accumulate_unsharded(modules: list[Any], *, last: bool) -> None:
    """Set the FSDP2 modules ``modules`` (a stage's root and its layer units: all of them,
    so no walk of the module tree is needed, as ``recurse=True`` would do twice a step)
    to keep their gradients unsharded, accumulated over the microbatches (``last``
    False: before the step's first action), or to reduce them and reshard after the next
    backward (``last``: the step's reduction)."""
    for m in modules:
        m.set_requires_gradient_sync(last, recurse=False)
        m.set_reshard_after_backward(last, recurse=False)
    modules[0].set_is_last_backward(last)


def cast_inputs(layer: nn.Module, dtype: torch.dtype) -> None:
    """Cast ``layer``'s floating-point inputs to ``dtype`` before its forward (FSDP2's
    ``cast_forward_inputs`` of a unit of its own): no-op in fp32."""
    from torch.distributed.utils import _cast_forward_inputs

    if dtype == torch.float32:
        return

    def cast(_module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        return _cast_forward_inputs(dtype, *args, **kwargs)

    layer.register_forward_pre_hook(cast, with_kwargs=True)


def sum_gradients(module: Any) -> None:
    """Reduce gradients over DP by summing, not averaging: every microbatch loss is
    already divided by the whole global batch's denominators (``models.multimodal``).
    Parameters a replica did not use this step (an encoder replica without images)
    reduce zeros, so every DP rank issues the same collectives."""
    module.set_gradient_divide_factor(1.0)
    module.set_force_sum_reduction_for_comms(True)
    unused = getattr(module, "set_reduce_scatter_unused_params", None)
    if unused is not None:      # torch >= 2.13 (pinned); an older one on a GPU host
        unused(True, recurse=False)


def param_groups(state: Any) -> list[Any]:
    """An FSDP2 state's parameter groups (a list from torch 2.13, the pinned version; one
    group or None before, as on some GPU hosts' torch)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def has_grad(fp: Any) -> bool:
    """Whether FSDP2 parameter ``fp`` has an unsharded gradient waiting for reduction."""
    return fp.unsharded_accumulated_grad is not None or (
        hasattr(fp, "_unsharded_param") and fp.unsharded_param.grad is not None)


def reduce_alone(group: Any) -> bool:
    """FSDP2's post-backward reduction of parameter group ``group`` where its DP mesh is
    one rank: each accumulated gradient becomes its parameter's gradient as it is (cast
    to the reduce dtype, then the parameter's, as FSDP2 casts; the sum over one rank is
    the gradient itself). FSDP2 (torch 2.13) still packs every gradient into one flat
    buffer there (``chunk_cat``, whose host side builds an int64 per 2 KiB of gradient
    and copies it to the device) and copies it out again: on an H200 that was a 19 ms
    host stall at the end of each step's backward, the device idle behind it
    (``benchmarks/step_vs_torch.py --trace-stack``). The same values, bitwise; the group's
    states end as FSDP2's ``post_backward`` leaves them. False, with nothing done, where
    the group is not alone on its mesh, keeps its gradients (``reduce_grads`` off) or
    offloads them (then FSDP2's own ``post_backward`` runs)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo,
        HSDPMeshInfo,
        TrainingState,
    )

    info = group.mesh_info
    if not isinstance(info, FSDPMeshInfo) or isinstance(info, HSDPMeshInfo) or \
            info.shard_mesh_size != 1 or not group.reduce_grads or \
            any(getattr(fp, "offload_to_cpu", False) for fp in group.fsdp_params):
        return False
    group._training_state = TrainingState.POST_BACKWARD
    for fp in group.fsdp_params:
        fp.accumulate_unsharded_grad_if_needed()
    grads = []
    for fp in group.fsdp_params:      # as FSDP2's post_backward picks them
        if not hasattr(fp, "_unsharded_param"):
            continue
        if fp.unsharded_accumulated_grad is not None:
            grads.append((fp, fp.unsharded_accumulated_grad_data))
            fp.unsharded_accumulated_grad = None
        elif fp.unsharded_param.grad is not None:
            grads.append((fp, fp.unsharded_grad_data))
            fp.unsharded_param.grad = None
        elif getattr(group, "reduce_scatter_unused_params", False) and \
                fp.unsharded_param.requires_grad:       # torch >= 2.13 (sum_gradients)
            grads.append((fp, fp.unsharded_zero_grad_data))
    if group.reshard_after_backward:
        group.reshard()
    reduce_dtype = group._reduce_dtype
    for fp, grad in grads:
        grad = grad.to(reduce_dtype or grad.dtype).to(group._orig_dtype or grad.dtype)
        grad = grad.contiguous().view(fp.sharded_size)
        if fp.sharded_param.grad is not None:
            fp.sharded_param.grad._local_tensor += grad
        else:
            fp.sharded_param.grad = fp.to_sharded_dtensor(grad)
        for hook in (getattr(fp.sharded_param, "_post_accumulate_grad_hooks", {})
                     or {}).values():
            hook(fp.sharded_param)
    return True


def zero_unused_in_reduce_dtype(group: Any) -> None:
    """Give the trainable parameters of FSDP2 parameter group ``group`` that had no
    gradient this step a zero one in the reduce dtype. FSDP2 reduces unused parameters'
    zeros (``sum_gradients``) in the compute dtype, while the others' gradients,
    accumulated over the microbatches, are in the reduce dtype: under mixed precision
    (bf16, fp16) a group with both (a co-located encoder's projector beside the
    backbone's embedding, on a replica that drew no images) fails its reduce-scatter's
    uniform-dtype check."""
    reduce_dtype = getattr(group, "_reduce_dtype", None)
    if reduce_dtype is None:
        return
    for fp in group.fsdp_params:
        if not hasattr(fp, "_unsharded_param") or not fp.unsharded_param.requires_grad:
            continue
        if fp.unsharded_accumulated_grad is None and fp.unsharded_param.grad is None:
            fp.unsharded_accumulated_grad = torch.zeros_like(fp.unsharded_param.detach(),
                                                             dtype=reduce_dtype)


def tp_unreduced(members: Any) -> list[nn.Parameter]:
    """The trainable parameters of FSDP2 states ``members`` (every group, forward order)
    that are replicated over TP and whose gradients nothing reduces over TP, in the same
    order on every TP rank of the stage:

    * TP-sharded parameters (``Shard`` on TP) hold each rank's own slice: none of this;
    * a parameter TP left replicated, with a ``Partial`` gradient over TP (a
      sequence-parallel norm's: each rank saw its piece of the sequence) is summed over
      TP by FSDP2 itself before its reduce-scatter (``FSDPParam._get_grad_inner_tensor``):
      its copies are equal already, do not reduce it twice;
    * every other replicated parameter is a candidate: one TP did not touch (norms, patch
      and position embeddings, projectors, a U-Net's convolutions, a ``tp_replicated``
      module), and a ``Replicate`` DTensor whose gradient is ``Replicate`` too (a row-
      parallel projection's bias: each rank computes it whole from the same output
      gradient). So is one with no gradient this step (placement unknown, and its DP
      peers' gradients may still differ): averaging equal values changes nothing.

    Read from the unsharded gradients before FSDP2's reduction frees them."""
    out = []
    for member in members:
        for group in param_groups(member):
            for fp in group.fsdp_params:
                if fp.sharded_param.requires_grad and _tp_replicated(fp):
                    out.append(fp.sharded_param)
    return out


def _tp_replicated(fp: Any) -> bool:
    """Whether FSDP2 parameter ``fp`` is replicated over TP and its gradient left unequal
    there (``tp_unreduced``)."""
    spec = getattr(fp, "_unsharded_dtensor_spec", None)
    if spec is None:            # a plain parameter: TP did not touch it
        return True
    names = spec.mesh.mesh_dim_names or ()
    if "tp" not in names:
        return True
    if spec.placements[names.index("tp")].is_shard():
        return False
    grad = fp.unsharded_accumulated_grad
    if grad is None and hasattr(fp, "_unsharded_param"):
        grad = fp.unsharded_param.grad
    placement = None if grad is None else _tp_placement(grad)
    return placement is None or not placement.is_partial()


def _tp_placement(t: Any) -> Any:
    """The placement of DTensor ``t`` on its mesh's ``tp`` dimension; None for a plain
    tensor or a DTensor on a mesh without one (a parameter TP did not touch: FSDP2 made it
    a DTensor over DP only)."""
    mesh = getattr(t, "device_mesh", None)
    names = getattr(mesh, "mesh_dim_names", None) or ()
    return t.placements[names.index("tp")] if "tp" in names else None
