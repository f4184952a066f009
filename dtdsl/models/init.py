"""Deterministic initialisation that does not depend on the parallel layout.

Every parameter's initial value is a function of the spec seed, the unit's name, the
parameter's name and the *position of each element in the full (single-process) tensor*,
never of which rank holds it or in which order ranks are built. A rank that materialises
only its layers and TP shards (``torch.device("meta")`` first, then ``to_empty``) computes
exactly the elements the single-process reference holds at the same positions, so runs of
any plan start from the same weights, and no rank ever builds a tensor it does not own.

The random numbers come from a counter-based generator: element ``i`` of a parameter draws
its normal variate from two 32-bit hashes of ``i`` under the parameter's two keys (Box-
Muller). Integer hashing is exact on every device; the float transform may differ in the
last bit between CPU and CUDA kernels, nothing more.

The scheme is Llama's as torchtitan sets it (not PyTorch's defaults): linear weights
``N(0, 0.02)``; the projections that write into the residual stream (attention ``wo``, MLP
``w2``, a GEGLU's ``out``) ``N(0, 0.02 / sqrt(2 * layers))``; token embeddings ``N(0, 1)``
(learned position embeddings ``N(0, 0.02)``, a class token ``N(0, hidden**-0.5)``);
the LM head ``N(0, hidden**-0.5)``; convolutions ``N(0, fan_in**-0.5)``; norms' weights one,
biases zero; modules marked ``zero_init`` (a DiT's modulation and output, whose zero start
makes each block the identity) zero. Normal draws are clamped at three standard
deviations (a truncated normal, as torchtitan's ``trunc_normal_``).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["InitRule", "hash_normal_", "init_module", "init_rule", "local_block", "param_keys"]

_M32 = 0xFFFFFFFF
_CHUNK = 1 << 22            # elements hashed at once: bounds the int64 temporaries
_RESIDUAL_OUT = {"wo", "w2", "out"}
_STD = 0.02
_NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)


@dataclass(frozen=True, slots=True)
class InitRule:
    """How one parameter starts: ``normal`` (std), ``ones`` or ``zeros``."""

    kind: str
    std: float = 0.0


def param_keys(seed: int, unit: str, name: str) -> tuple[int, int]:
    """The two 32-bit keys of parameter ``name`` of ``unit`` under the spec ``seed``."""
    digest = hashlib.sha256(f"dtdsl-init:{seed}:{unit}:{name}".encode()).digest()
    return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:8], "little")


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (lowbias32) of int64 values in [0, 2**32); int64 products wrap
    modulo 2**64, so their low 32 bits are exact."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def _normal_of(index: torch.Tensor, keys: tuple[int, int]) -> torch.Tensor:
    """Standard normal variates (float32) for flat element indices ``index`` (int64)."""
    lo = index & _M32
    hi = index >> 32
    a = _hash32(_hash32(lo ^ keys[0]) ^ hi)
    b = _hash32(_hash32(lo ^ keys[1]) ^ (hi + 0x9E3779B9))
    u1 = (a.double() + 1.0) / 4294967297.0          # (0, 1): log stays finite
    u2 = b.double() / 4294967296.0
    return (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)).float()


def hash_normal_(local: torch.Tensor, *, keys: tuple[int, int], full_shape: Sequence[int],
                 offsets: Sequence[int], std: float, clamp: float = 3.0) -> torch.Tensor:
    """Fill ``local``, the block of a tensor of ``full_shape`` that starts at ``offsets``
    (one per dimension), with ``N(0, std)`` clamped at ``clamp`` standard deviations: each
    element's value is a function of ``keys`` and its flat index in the full tensor."""
    if local.dim() != len(full_shape) or len(offsets) != len(full_shape):
        raise ValueError(f"a block of rank {local.dim()} in a tensor of shape "
                         f"{tuple(full_shape)} with offsets {tuple(offsets)}")
    if local.numel() == 0:
        return local
    device = local.device
    strides = [1] * len(full_shape)
    for d in range(len(full_shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * int(full_shape[d + 1])
    flat = local.view(-1) if local.is_contiguous() else None
    out = torch.empty(local.numel(), dtype=torch.float32, device=device)
    # Flat index of every local element, row block by row block along dim 0.
    inner = torch.zeros((), dtype=torch.int64, device=device)
    for d in range(1, local.dim()):
        idx = (torch.arange(local.shape[d], device=device) + int(offsets[d])) * strides[d]
        inner = inner.unsqueeze(-1) + idx
    inner = inner.reshape(-1)
    rows = local.shape[0] if local.dim() else 1
    per_row = max(1, inner.numel())
    step = max(1, _CHUNK // per_row)
    base = int(offsets[0]) if local.dim() else 0
    stride0 = strides[0] if local.dim() else 1
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        row_idx = (torch.arange(r0, r1, device=device) + base) * stride0
        index = (row_idx.unsqueeze(-1) + inner).reshape(-1)
        z = _normal_of(index, keys).clamp_(-clamp, clamp).mul_(std)
        out[r0 * per_row:r1 * per_row] = z
    with torch.no_grad():
        if flat is not None:
            flat.copy_(out)
        else:
            local.copy_(out.view(local.shape))
    return local


def init_rule(owner: nn.Module, attr: str, param: torch.Tensor, num_layers: int,
              *, head: bool = False) -> InitRule:
    """The rule for parameter ``attr`` of module ``owner`` in a unit of ``num_layers``
    layers; ``head``: the unit's output head (an LM head)."""
    if getattr(owner, "zero_init", False):
        return InitRule("zeros")
    if isinstance(owner, _NORMS):
        return InitRule("ones" if attr == "weight" else "zeros")
    stds = getattr(owner, "param_init_std", {})
    if attr in stds:        # a module's own parameter with its own scale (a class token)
        return InitRule("normal", stds[attr])
    if attr == "bias" or param.dim() < 2:
        return InitRule("zeros")
    if isinstance(owner, nn.Embedding):
        return InitRule("normal", getattr(owner, "init_std", 1.0))
    if head:
        return InitRule("normal", param.shape[-1] ** -0.5)
    if isinstance(owner, nn.modules.conv._ConvNd):
        fan_in = param[0].numel()
        return InitRule("normal", fan_in ** -0.5)
    if attr == "weight" and getattr(owner, "residual_out", False):
        return InitRule("normal", _STD / math.sqrt(2 * max(1, num_layers)))
    return InitRule("normal", _STD)


def local_block(param: torch.Tensor, owner: nn.Module | None = None, attr: str = ""
                ) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(local tensor, full shape, offsets of the local block) of a plain tensor or a
    DTensor (any placements whose local block is contiguous in the full tensor). A module
    that holds only part of its parameter's full tensor outside any DTensor (an
    expert-parallel MoE block's experts, ``parallel.ep``) says where with its
    ``global_block(attr, shape, offsets)``: ``owner`` is the module, ``attr`` the name."""
    local, shape, offsets = _dtensor_block(param)
    place = getattr(owner, "global_block", None)
    return (local, *place(attr, shape, offsets)) if place is not None else (local, shape,
                                                                            offsets)


def _dtensor_block(param: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    to_local = getattr(param, "to_local", None)
    if not callable(to_local):
        return param, tuple(param.shape), (0,) * param.dim()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = to_local()
    shape, offsets = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements)
    if tuple(shape) != tuple(local.shape):
        raise ValueError(f"a DTensor of placements {param.placements} whose local block "
                         f"{tuple(local.shape)} is not {tuple(shape)}")
    return local, tuple(param.shape), tuple(offsets)


@torch.no_grad()
def init_module(module: nn.Module, *, seed: int, unit: str, prefix: str = "",
                num_layers: int = 1, head: str | None = None,
                skip: set[int] | None = None) -> None:
    """Initialise every parameter of ``module`` (materialised: plain tensors or DTensors
    with contiguous local blocks) by the layout-independent rules above. ``prefix`` is
    ``module``'s name inside the unit (so a layer built alone draws what the whole unit
    draws at that name); ``head``: the name (inside the unit) of the LM head's module;
    parameters whose ``id`` is in ``skip`` are left as they are. A parameter shared by two
    modules (a tied LM head) is initialised once, by its first owner's rule and name: on
    every stage that holds it (the embedding comes first), whatever else it holds."""
    done = set(skip or ())
    for mod_name, owner in module.named_modules(prefix=prefix.rstrip(".")):
        for attr, param in owner.named_parameters(recurse=False):
            if id(param) in done:
                continue
            done.add(id(param))
            name = f"{mod_name}.{attr}" if mod_name else attr
            rule = init_rule(owner, attr, param, num_layers, head=head is not None
                             and mod_name == head)
            local, full_shape, offsets = local_block(param, owner, attr)
            if rule.kind == "zeros":
                local.zero_()
            elif rule.kind == "ones":
                local.fill_(1.0)
            else:
                hash_normal_(local, keys=param_keys(seed, unit, name), full_shape=full_shape,
                             offsets=offsets, std=rule.std)
