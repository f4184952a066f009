"""Tensor parallelism for every unit (encoders, backbones, U-Net and DiT generators),
with DTensor.

``shard_unit(module, tp, tp_rank, group)`` turns a full unit (built with ``tp=1`` from
the unit's seed, so every TP rank starts from the same weights) into this rank's shard,
in place, with ``torch.distributed.tensor.parallel.parallelize_module`` on every
attention and MLP block it contains (``SelfAttention``, ``CrossAttention``, ``MLP``, the
U-Net's ``GEGLU``) over a one-dimensional ``DeviceMesh`` of the TP process group:

* ``ColwiseParallel``: the block's input projections (the fused QKV matrix; a cross
  attention's query and fused key/value matrices; the MLP's first matrix, with SwiGLU or
  GEGLU the fused gate and value projections) become ``Shard(0)`` DTensors (a bias too);
  their input is ``Replicate`` (its gradient is all-reduced over the group in backward)
  and their output this rank's slice, a plain local tensor;
* ``RowwiseParallel``: the attention output and the MLP's last matrix become ``Shard(1)``
  DTensors, take the local slice and all-reduce their partial sums to a replicated
  plain tensor (the gradient passes unchanged); a bias there is a ``Replicate`` DTensor,
  added once;
* replicated: norms, embeddings, the output head (not vocabulary parallel yet), the
  U-Net's convolutions, a DiT's modulation and everything outside the blocks stay plain
  tensors.

So every activation outside the attention and MLP blocks, and the gradient of every
replicated parameter, is the same on every TP rank, and the local shards of the sharded
weights get exactly the slices of the single-process gradients.

Fused matrices: ``ColwiseParallel`` cuts a weight into contiguous row blocks, but the
fused ``[Q | K | V]``, ``[K | V]``, ``[gate | up]`` and ``[value | gate]`` matrices need one
block of *each* segment per rank (rank ``r``: its query heads, its KV heads, its FFN
columns). Their rows (and bias) are therefore permuted before sharding into rank-major
order (``ShardSplit``: rank ``r``'s blocks of every segment, then rank ``r + 1``'s), so
that block ``r`` of the permuted matrix is exactly rank ``r``'s slices and the block's
forward splits its local output by its local head counts. ``TPLayout.full`` undoes the
permutation: checkpoints and checks see the single-process layout and names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtdsl.models.transformer import MLP, CrossAttention, SelfAttention

__all__ = ["ShardSplit", "TPLayout", "local_tensor", "shard_unit"]


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
    """What ``shard_unit`` did to one module on one rank."""

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

    def full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The full value of parameter (or gradient, or optimizer state) ``name``, in the
        single-process layout, from this rank's ``local`` one (a DTensor or its local
        tensor): an all-gather over the TP group for sharded ones (collective), ``local``
        itself otherwise."""
        split = self.splits.get(name)
        if split is None:
            return local_tensor(local)      # a replicated DTensor's local tensor is whole
        local = local_tensor(local.detach()).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.tp)]
        dist.all_gather(parts, local, group=self.group)
        return split.join(parts)


def _rank_major(split: ShardSplit, full: torch.Tensor, tp: int) -> torch.Tensor:
    """``full`` with its ``split.dim`` reordered so that contiguous block ``r`` of ``tp``
    is rank ``r``'s shard (``split.take``)."""
    return torch.cat([split.take(full, tp, r) for r in range(tp)], dim=split.dim)


def _tp_mesh(group: Any, tp: int, rank: int) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh.from_group(group, "cpu")
    if mesh.size() != tp or mesh.get_local_rank() != rank:
        raise ValueError(f"the TP group has {mesh.size()} ranks with this one at "
                         f"{mesh.get_local_rank()}, not {tp} with it at {rank}")
    return mesh


@dataclass(frozen=True)
class _Cut:
    """How ``parallelize_module`` cuts one linear layer of a block: column-wise (its
    weight's rows and bias split by ``weight``, permuted rank-major first) or row-wise
    (its weight's columns split; a bias stays replicated and is added once)."""

    style: str                  # "col" or "row"
    weight: ShardSplit


def _block_cuts(block: nn.Module) -> tuple[list[tuple[str, int]], dict[str, _Cut]] | None:
    """The counts a TP degree must divide and the cut of every linear layer of an
    attention or MLP block; None for any other module."""
    from dtdsl.models.unet import GEGLU

    if isinstance(block, SelfAttention):
        d = block.head_dim
        q, kv = block.heads * d, block.kv_heads * d
        return ([("attention heads", block.heads), ("KV heads", block.kv_heads)],
                {"wqkv": _Cut("col", ShardSplit(0, (q, kv, kv))),
                 "wo": _Cut("row", ShardSplit(1, (q,)))})
    if isinstance(block, CrossAttention):
        hd = block.heads * block.head_dim
        return ([("attention heads", block.heads)],
                {"wq": _Cut("col", ShardSplit(0, (hd,))),
                 "wkv": _Cut("col", ShardSplit(0, (hd, hd))),
                 "wo": _Cut("row", ShardSplit(1, (hd,)))})
    if isinstance(block, MLP):
        ffn = block.w2.in_features
        return ([("FFN columns", ffn)],
                {"w1": _Cut("col", ShardSplit(0, (ffn, ffn) if block.swiglu else (ffn,))),
                 "w2": _Cut("row", ShardSplit(1, (ffn,)))})
    if isinstance(block, GEGLU):
        inner = block.out.in_features
        return ([("FFN columns", inner)],
                {"proj": _Cut("col", ShardSplit(0, (inner, inner))),
                 "out": _Cut("row", ShardSplit(1, (inner,)))})
    return None


def shard_unit(module: nn.Module, tp: int, rank: int, group: Any) -> TPLayout:
    """Shard every attention and MLP block of ``module`` (a unit built with ``tp=1``: an
    encoder, a backbone, a U-Net or DiT generator) for TP rank ``rank`` of ``tp`` in place;
    see the module docstring. ``group`` is the TP process group (its ranks in TP-index
    order)."""
    if tp < 1 or not 0 <= rank < tp:
        raise ValueError(f"TP rank {rank} is outside 0..{tp - 1}")
    layout = TPLayout(tp=tp, rank=rank, group=group)
    if tp == 1:
        return layout
    if getattr(module, "tp", 1) != 1:
        raise ValueError("build the module with tp=1; shard_unit cuts the shard")
    blocks = [(name, block, cuts) for name, block in module.named_modules()
              if (cuts := _block_cuts(block)) is not None]
    if not blocks:
        raise NotImplementedError(f"{type(module).__name__}: tensor parallelism shards "
                                  "attention and MLP blocks, and it has none")
    for name, _, (counts, _) in blocks:     # check every block before changing any
        for what, count in counts:
            if count % tp:
                raise ValueError(f"tensor parallelism {tp} cannot split {count} {what} "
                                 f"evenly ({name})")

    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    layout.mesh = _tp_mesh(group, tp, rank)
    for name, block, (_, cuts) in blocks:
        with torch.no_grad():
            for attr, cut in cuts.items():
                if cut.style == "col" and len(cut.weight.segments) > 1:
                    linear = getattr(block, attr)
                    for param in (linear.weight, linear.bias):
                        if param is not None:
                            param.copy_(_rank_major(cut.weight, param, tp))
        # Every rank holds the same full weights (same seed): each keeps its block, no
        # communication (src_data_rank=None).
        parallelize_module(block, layout.mesh, {
            attr: ColwiseParallel() if cut.style == "col" else RowwiseParallel()
            for attr, cut in cuts.items()}, src_data_rank=None)
        prefix = f"{name}." if name else ""
        for attr, cut in cuts.items():
            layout.splits[f"{prefix}{attr}.weight"] = cut.weight
            if cut.style == "col" and getattr(block, attr).bias is not None:
                layout.splits[f"{prefix}{attr}.bias"] = cut.weight
        # The forward reshapes by head count: use this rank's heads.
        if isinstance(block, SelfAttention):
            block.heads //= tp
            block.kv_heads //= tp
        elif isinstance(block, CrossAttention):
            block.heads //= tp
    return layout
