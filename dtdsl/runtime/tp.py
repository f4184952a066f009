"""Tensor parallelism for the transformer units (encoder and backbone), with DTensor.

``shard_transformer(module, tp, tp_rank, group)`` turns a full ``Encoder`` or
``Backbone`` (built with ``tp=1`` from the unit's seed, so every TP rank starts from
the same weights) into this rank's shard, in place, with
``torch.distributed.tensor.parallel.parallelize_module`` on every transformer layer
over a one-dimensional ``DeviceMesh`` of the TP process group:

* ``ColwiseParallel``: the fused QKV matrix and the MLP's first matrix (with SwiGLU, the
  fused gate and up projections) become ``Shard(0)`` DTensors; their input is
  ``Replicate`` (its gradient is all-reduced over the group in backward) and their output
  this rank's slice, a plain local tensor;
* ``RowwiseParallel``: the attention output and the MLP's last matrix become ``Shard(1)``
  DTensors, take the local slice and all-reduce their partial sums to a replicated
  plain tensor (the gradient passes unchanged);
* replicated: norms, the patch / token embedding, the output head (not vocabulary
  parallel yet) and everything outside the layers stay plain tensors.

So every activation outside the attention and MLP blocks, and the gradient of every
replicated parameter, is the same on every TP rank, and the local shards of the sharded
weights get exactly the slices of the single-process gradients.

Fused matrices: ``ColwiseParallel`` cuts a weight into contiguous row blocks, but the
fused ``[Q | K | V]`` and ``[gate | up]`` matrices need one block of *each* segment per
rank (rank ``r``: its query heads, its KV heads, its FFN columns). Their rows are
therefore permuted before sharding into rank-major order (``ShardSplit``: rank ``r``'s
blocks of every segment, then rank ``r + 1``'s), so that block ``r`` of the permuted
matrix is exactly rank ``r``'s slices and the layer's forward splits its local output by
its local head counts. ``TPLayout.full`` undoes the permutation: checkpoints and checks
see the single-process layout and names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtdsl.runtime.models.transformer import MLP, SelfAttention, TransformerLayer

__all__ = ["ShardSplit", "TPLayout", "local_tensor", "shard_transformer"]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor of a DTensor (sharing its storage), or ``t`` itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


@dataclass(frozen=True, slots=True)
class ShardSplit:
    """How one parameter is split: along ``dim`` the full tensor is a concatenation of
    ``segments`` (sizes); each segment is cut into ``tp`` equal blocks and rank ``r``
    holds block ``r`` of every segment, concatenated."""

    dim: int
    segments: tuple[int, ...]

    def take(self, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
        """Rank ``rank``'s shard of ``full``."""
        pieces, offset = [], 0
        for n in self.segments:
            block = n // tp
            pieces.append(full.narrow(self.dim, offset + rank * block, block))
            offset += n
        return torch.cat(pieces, dim=self.dim)

    def join(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's shard, in rank order."""
        tp = len(shards)
        cuts = [n // tp for n in self.segments]
        split = [s.split(cuts, dim=self.dim) for s in shards]
        return torch.cat([split[r][i] for i in range(len(cuts)) for r in range(tp)],
                         dim=self.dim)


@dataclass(eq=False)
class TPLayout:
    """What ``shard_transformer`` did to one module on one rank."""

    tp: int
    rank: int
    group: Any
    mesh: Any = None                                              # the TP DeviceMesh
    splits: dict[str, ShardSplit] = field(default_factory=dict)   # by parameter name

    def is_sharded(self, name: str) -> bool:
        return name in self.splits

    def replicated(self, module: nn.Module) -> list[nn.Parameter]:
        """The module's parameters that are whole (and equal) on every TP rank."""
        return [p for n, p in module.named_parameters() if n not in self.splits]

    def local_shape(self, name: str, full: Sequence[int]) -> list[int]:
        """The shape of this rank's shard of parameter ``name`` of full shape ``full``."""
        shape = list(full)
        split = self.splits.get(name)
        if split is not None:
            shape[split.dim] //= self.tp
        return shape

    def full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The full value of parameter (or gradient, or optimizer state) ``name``, in the
        single-process layout, from this rank's ``local`` one (a DTensor or its local
        tensor): an all-gather over the TP group for sharded ones (collective), ``local``
        itself otherwise."""
        split = self.splits.get(name)
        if split is None:
            return local
        local = local_tensor(local.detach()).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.tp)]
        dist.all_gather(parts, local, group=self.group)
        return split.join(parts)


def _rank_major(split: ShardSplit, full: torch.Tensor, tp: int) -> torch.Tensor:
    """``full`` with its ``split.dim`` reordered so that contiguous block ``r`` of ``tp``
    is rank ``r``'s shard (``split.take``)."""
    return torch.cat([split.take(full, tp, r) for r in range(tp)], dim=split.dim)


def _check_linear(linear: nn.Linear, what: str, *, row: bool) -> None:
    if row and linear.bias is not None:
        # DTensor would add a replicated bias to partial sums; not needed by our layers.
        raise NotImplementedError(f"{what}: row-parallel layers with a bias are not "
                                  "supported by tensor parallelism yet")


def _tp_mesh(group: Any, tp: int, rank: int) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh.from_group(group, "cpu")
    if mesh.size() != tp or mesh.get_local_rank() != rank:
        raise ValueError(f"the TP group has {mesh.size()} ranks with this one at "
                         f"{mesh.get_local_rank()}, not {tp} with it at {rank}")
    return mesh


def shard_transformer(module: nn.Module, tp: int, rank: int, group: Any) -> TPLayout:
    """Shard the transformer layers of ``module`` (an ``Encoder`` or ``Backbone`` built
    with ``tp=1``) for TP rank ``rank`` of ``tp`` in place; see the module docstring.
    ``group`` is the TP process group (its ranks in TP-index order)."""
    if tp < 1 or not 0 <= rank < tp:
        raise ValueError(f"TP rank {rank} is outside 0..{tp - 1}")
    layout = TPLayout(tp=tp, rank=rank, group=group)
    if tp == 1:
        return layout
    layers = getattr(module, "layers", None)
    if layers is None or not all(isinstance(layer, TransformerLayer) for layer in layers):
        raise NotImplementedError(f"{type(module).__name__}: tensor parallelism shards "
                                  "transformer layers only")
    if getattr(module, "tp", 1) != 1:
        raise ValueError("build the module with tp=1; shard_transformer cuts the shard")
    for i, layer in enumerate(layers):     # check every layer before changing any
        attn: SelfAttention = layer.attn
        mlp: MLP = layer.mlp
        for what, count in (("attention heads", attn.heads), ("KV heads", attn.kv_heads),
                            ("FFN columns", mlp.w2.in_features)):
            if count % tp:
                raise ValueError(f"tensor parallelism {tp} cannot split {count} {what} "
                                 "evenly")
        _check_linear(attn.wo, f"layers.{i}.attn.wo", row=True)
        _check_linear(mlp.w2, f"layers.{i}.mlp.w2", row=True)

    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    layout.mesh = _tp_mesh(group, tp, rank)
    for i, layer in enumerate(layers):
        attn, mlp = layer.attn, layer.mlp
        d = attn.head_dim
        q, kv = attn.heads * d, attn.kv_heads * d
        ffn = mlp.w2.in_features
        fused = {"attn.wqkv": ShardSplit(0, (q, kv, kv)),
                 "mlp.w1": ShardSplit(0, (ffn, ffn) if mlp.swiglu else (ffn,))}
        with torch.no_grad():
            for name, split in fused.items():
                weight = layer.get_submodule(name).weight
                weight.copy_(_rank_major(split, weight, tp))
        # Every rank holds the same full weights (same seed): each keeps its block, no
        # communication (src_data_rank=None).
        parallelize_module(layer, layout.mesh, {
            "attn.wqkv": ColwiseParallel(), "attn.wo": RowwiseParallel(),
            "mlp.w1": ColwiseParallel(), "mlp.w2": RowwiseParallel(),
        }, src_data_rank=None)
        prefix = f"layers.{i}"
        layout.splits.update({
            f"{prefix}.attn.wqkv.weight": fused["attn.wqkv"],
            f"{prefix}.attn.wo.weight": ShardSplit(1, (q,)),
            f"{prefix}.mlp.w1.weight": fused["mlp.w1"],
            f"{prefix}.mlp.w2.weight": ShardSplit(1, (ffn,)),
        })
        # The forward reshapes by head count: use this rank's heads.
        attn.heads //= tp
        attn.kv_heads //= tp
    return layout
