"""Megatron-style tensor parallelism for the transformer units (encoder and backbone).

``shard_transformer(module, tp, tp_rank, group)`` turns a full ``Encoder`` or
``Backbone`` (built with ``tp=1`` from the unit's seed, so every TP rank starts from
the same weights) into this rank's shard, in place:

* column-parallel: the fused QKV matrix keeps this rank's query heads and KV heads
  (``heads / tp`` and ``kv_heads / tp`` of each of Q, K and V), the MLP's first matrix
  this rank's FFN columns (of the gate and of the up projection with SwiGLU);
* row-parallel: the attention output and the MLP's last matrix keep the matching
  input columns and produce partial sums;
* replicated: norms, the patch / token embedding, the output head (not vocabulary
  parallel yet) and everything outside the layers.

Each attention and MLP block gets two hooks: on its input an identity whose backward
all-reduces the input gradient over the TP group (the replicated activation feeds every
rank's shard), on its output an all-reduce of the partial sums whose backward is the
identity. So every activation outside the blocks, and the gradient of every replicated
parameter, is the same on every TP rank, and the local shards of the sharded weights
get exactly the slices of the single-process gradients.

Why not DTensor ``ColwiseParallel``: it shards a weight into contiguous row blocks,
but the fused QKV matrix (rows ``[Q | K | V]``) and the fused SwiGLU matrix
(``[gate | up]``) need one block from *each* segment per rank. DTensor would need the
weights re-laid out first (so parameter layouts would no longer match the
single-process model's) and a DeviceMesh per TP sub-group; the explicit slices keep
plain local parameters whose names and meanings equal the reference's, which the
optimizer (``tp_replicated``) and the checks use directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtdsl.runtime.models.transformer import MLP, SelfAttention, TransformerLayer

__all__ = ["ShardSplit", "TPLayout", "copy_to_tp", "reduce_from_tp", "shard_transformer"]


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce (sum) forward; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``x`` unchanged; its gradient is summed over ``group`` (column-parallel input)."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The sum of ``x`` over ``group``; the gradient passes unchanged (row-parallel output)."""
    return _ReduceFromTP.apply(x, group)


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
    splits: dict[str, ShardSplit] = field(default_factory=dict)   # by parameter name
    handles: list[Any] = field(default_factory=list)              # the hooks

    def is_sharded(self, name: str) -> bool:
        return name in self.splits

    def replicated(self, module: nn.Module) -> list[nn.Parameter]:
        """The module's parameters that are whole (and equal) on every TP rank."""
        return [p for n, p in module.named_parameters() if n not in self.splits]

    def full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The full value of parameter (or gradient) ``name`` from this rank's ``local``
        one: an all-gather over the TP group for sharded ones (collective), ``local``
        itself otherwise."""
        split = self.splits.get(name)
        if split is None:
            return local
        local = local.detach().contiguous()
        parts = [torch.empty_like(local) for _ in range(self.tp)]
        dist.all_gather(parts, local, group=self.group)
        return split.join(parts)


def _shard_param(module: nn.Module, attr: str, split: ShardSplit, tp: int, rank: int) -> None:
    old: nn.Parameter = getattr(module, attr)
    new = nn.Parameter(split.take(old.detach(), tp, rank).clone(),
                       requires_grad=old.requires_grad)
    setattr(module, attr, new)
    if isinstance(module, nn.Linear):   # keep the reported shape honest
        module.out_features, module.in_features = new.shape


def _check_linear(linear: nn.Linear, what: str, *, row: bool) -> None:
    if row and linear.bias is not None:
        # A row-parallel bias would be added once per rank before the sum.
        raise NotImplementedError(f"{what}: row-parallel layers with a bias are not "
                                  "supported by tensor parallelism yet")


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

    def pre(mod: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (copy_to_tp(args[0], group), *args[1:])

    def post(mod: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        return reduce_from_tp(out, group)

    for i, layer in enumerate(layers):
        attn: SelfAttention = layer.attn
        mlp: MLP = layer.mlp
        prefix = f"layers.{i}"
        for what, count in (("attention heads", attn.heads), ("KV heads", attn.kv_heads)):
            if count % tp:
                raise ValueError(f"tensor parallelism {tp} cannot split {count} {what} "
                                 "evenly")
        _check_linear(attn.wo, f"{prefix}.attn.wo", row=True)
        _check_linear(mlp.w2, f"{prefix}.mlp.w2", row=True)
        d = attn.head_dim
        q, kv = attn.heads * d, attn.kv_heads * d
        ffn = mlp.w2.in_features
        if ffn % tp:
            raise ValueError(f"tensor parallelism {tp} cannot split {ffn} FFN columns evenly")
        splits = {
            (attn.wqkv, "weight", f"{prefix}.attn.wqkv.weight"): ShardSplit(0, (q, kv, kv)),
            (attn.wo, "weight", f"{prefix}.attn.wo.weight"): ShardSplit(1, (q,)),
            (mlp.w1, "weight", f"{prefix}.mlp.w1.weight"):
                ShardSplit(0, (ffn, ffn) if mlp.swiglu else (ffn,)),
            (mlp.w2, "weight", f"{prefix}.mlp.w2.weight"): ShardSplit(1, (ffn,)),
        }
        for (owner, attr, name), split in splits.items():
            _shard_param(owner, attr, split, tp, rank)
            layout.splits[name] = split
        # The forward reshapes by head count: use this rank's heads.
        attn.heads //= tp
        attn.kv_heads //= tp
        for block in (attn, mlp):
            layout.handles.append(block.register_forward_pre_hook(pre))
            layout.handles.append(block.register_forward_hook(post))
    return layout
