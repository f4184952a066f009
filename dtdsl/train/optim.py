"""AdamW with ZeRO stage 1, and the job-wide gradient norm and inf/NaN agreement.

One :class:`Zero1AdamW` holds the parameters of one unit's pipeline stage on one rank
(Megatron MIMO: one optimizer per module). Its step has three phases, split so that the
job-wide decisions can sit between them::

    for opt in optimizers: opt.reduce_grads(grad_scale)      # (a) DP reduce(-scatter)
    found_inf = found_nonfinite(any(opt.local_nonfinite()))   # one all_reduce(MAX), all ranks
    norm = global_grad_norm(sum(opt.grad_sq_norm()))           # one all_reduce(SUM), all ranks
    for opt: opt.skip() if found_inf else opt.apply(clip_coefficient(norm, max_norm))  # (b)+(c)

:func:`optimizer_step` computes exactly that with fewer passes and one collective fewer:
each optimizer's squared norm and inf/NaN flag come from one float64 reduction over its
shard where the norm covers the whole shard (:meth:`Zero1AdamW.grad_sq_norm_and_nonfinite`:
a float64 sum of squares of fp32 values cannot overflow, so it is non-finite exactly when
an element is), and the flag and the norm travel in one ``all_reduce(SUM)`` of float64
numbers (a positive flag sum means some rank saw inf/NaN), with any ``totals`` the
caller wants summed over the job (the executor's losses) in the same message. Every rank
of the job must call it (with an empty list where a rank has nothing to train, e.g. a
frozen generator), because the norm and the inf flag are collectives over the whole world
group.

**ZeRO-1 layout.** The rank's parameters, in the order given, are flattened into one fp32
buffer of ``numel`` elements, padded with zeros to a multiple of the DP size; DP rank ``r``
owns the contiguous shard ``[r * S, (r + 1) * S)`` with ``S = padded / dp``. The fp32 Adam
moments (and the fp32 master weights when the parameters are not fp32) exist only for the
shard. With ``zero=0`` the "shard" is the whole buffer on every DP rank. The parameters
themselves are re-pointed (``.data``) at views of one flat buffer in the same layout, so
the update writes the rank's shard in place and the all-gather writes the others' shards
straight into the parameters (DTensor parameters keep their storage: the update reads
their shard out and the gather copies it back).

**Counting each gradient element once (the norm rule).** The global norm is
``sqrt(sum over ranks of the rank's contribution)``; a contribution must count every
parameter element of the job exactly once:

* DP: after the reduce every DP replica holds the same reduced gradient. With ZeRO-1 each
  DP rank counts only its own shard (the shards partition the buffer; padding is zero);
  with ``zero=0`` only DP rank 0 counts.
* TP: a TP-sharded parameter (column/row-parallel weight) holds a different slice on each
  TP rank, so every TP rank counts it; a TP-replicated parameter (norm weights, the bias of
  a row-parallel layer) is identical on every TP rank, so only TP rank 0 counts it.
  DTensor parameters are used through their local tensors; a ``Partial`` DTensor gradient
  (what autograd gives a replicated norm weight) is first reduced over its TP mesh.
* PP and units: different stages and units hold different parameters; each counts its own.
  (A parameter tied across stages, e.g. shared input/output embeddings, would have to be
  counted on one stage only; nothing here handles ties.)

:meth:`Zero1AdamW.grad_sq_norm` applies this rule for its parameters;
:func:`local_grad_sq_norm` applies it to plain ``.grad`` tensors that are already
DP-reduced (a module trained without this optimizer).

Communication: on NCCL ``reduce_scatter_tensor`` / ``all_gather_into_tensor``; gloo has no
reduce-scatter, so there the gradient is all-reduced and each rank keeps its shard, and the
gather is a list ``all_gather``. Gradients are reduced in fp32 (upcast before the reduce);
the all-gather moves the parameter dtype.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dtdsl.parallel.tp import local_tensor

__all__ = [
    "StepResult",
    "Zero1AdamW",
    "clip_coefficient",
    "found_nonfinite",
    "global_grad_norm",
    "local_grad_sq_norm",
    "optimizer_step",
]

_STATE_VERSION = 1


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _local_grad(g: torch.Tensor) -> torch.Tensor:
    """The rank-local gradient. A DTensor gradient can be ``Partial`` (the grad of a
    replicated norm weight fed by a sharded activation holds per-TP-rank partial sums):
    reduce it to ``Replicate`` first, a collective over its mesh that every TP rank of the
    stage reaches in the same parameter order."""
    placements = getattr(g, "placements", None)
    if placements is not None and any(pl.is_partial() for pl in placements):
        from torch.distributed.tensor import Replicate

        g = g.redistribute(g.device_mesh,
                           [Replicate() if pl.is_partial() else pl for pl in placements])
    return local_tensor(g)


def _uses_nccl(group: Any, device: torch.device) -> bool:
    # A mixed backend ("cpu:gloo,cuda:nccl") picks by the tensor's device.
    return device.type == "cuda" and "nccl" in str(dist.get_backend(group))


def _scalar_device(group: Any) -> torch.device:
    if str(dist.get_backend(group)) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# Elements per chunk of the optimizer's element-wise passes that need a temporary (the
# float64 copy of the norm, Adam's denominator): the temporary is one small buffer reused
# every step, not a shard-sized tensor allocated and freed each time (on CPU every such
# allocation comes back as fresh pages: thousands of page faults per step). 2**16 floats
# also stay in L2 between the two ops that touch them.
_CHUNK = 1 << 16


def _sq_norm(t: torch.Tensor, scratch: torch.Tensor | None = None) -> float:
    """The squared 2-norm of ``t`` as a Python float, accumulated in float64: the square of
    a large fp32 gradient must not overflow to inf and be mistaken for a non-finite
    gradient, so it is non-finite exactly when an element is. A float64 copy and a dot
    product, ``_CHUNK`` elements at a time (a fifth of the time of
    ``vector_norm(dtype=float64)`` on CPU; products of fp32 values are exact in float64);
    ``scratch``: a float64 buffer of at least ``_CHUNK`` elements on ``t``'s device for
    the copies."""
    if t.numel() == 0:
        return 0.0
    total = 0.0
    for chunk in t.detach().reshape(-1).split(_CHUNK):
        if scratch is None:
            x = chunk.to(torch.float64)
        else:
            x = scratch[:chunk.numel()]
            x.copy_(chunk)
        total += float(torch.dot(x, x))
    return total


@dataclass(frozen=True, slots=True, kw_only=True)
class StepResult:
    """What :func:`optimizer_step` did on this rank (identical on every rank)."""

    skipped: bool
    grad_norm: float
    clip_coef: float
    totals: tuple[float, ...] = ()    # ``optimizer_step(totals=...)`` summed over the job


class Zero1AdamW:
    """AdamW (the ``torch.optim.AdamW`` formulas) for one rank's stage of one unit, with
    the optimizer state sharded over the unit's DP group (``zero=1``) or replicated
    (``zero=0``).

    Args:
        params: the stage's parameters on this rank, one dtype (fp32, bf16 or fp16) and one
            device, contiguous; DTensor parameters are used through their local tensor.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``. ``lr`` may be changed
            between steps (``opt.lr = ...``).
        zero: 1 to shard the state over ``dp_group``, 0 to keep it whole on every rank.
        dp_group: the unit's data-parallel group for this stage and TP index; ``None`` is
            the default group, and without ``torch.distributed`` the DP size is 1.
        average: divide the DP sum of gradients by the DP size. Pass ``False`` when the
            loss was already normalised by the global batch, so gradients are summed.
        tp_rank, tp_replicated: this rank's TP index and the parameters identical on every
            TP rank; those count in the gradient norm only on TP rank 0 (module docstring).
    """

    def __init__(self, params: Iterable[torch.Tensor], *, lr: float,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, zero: int = 1, dp_group: Any = None,
                 average: bool = True, tp_rank: int = 0,
                 tp_replicated: Iterable[torch.Tensor] = ()) -> None:
        self.params = list(params)
        if not self.params:
            raise ValueError("Zero1AdamW needs at least one parameter")
        if zero not in (0, 1):
            raise ValueError(f"zero={zero} is not supported: write zero=0 or zero=1")
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"betas {betas} must lie in [0, 1)")
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError("lr, eps and weight_decay must be non-negative")
        locals_ = [local_tensor(p) for p in self.params]
        dtypes = {t.dtype for t in locals_}
        devices = {t.device for t in locals_}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(f"parameters must share one dtype and one device, got "
                             f"{sorted(map(str, dtypes))} on {sorted(map(str, devices))}; "
                             "build one optimizer per dtype/device")
        if not all(t.is_contiguous() for t in locals_):
            raise ValueError("parameters must be contiguous")
        self.dtype = dtypes.pop()
        self.device = devices.pop()
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay
        self.zero, self.average = zero, average
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group) if _dist_on() else 1
        self.dp_rank = dist.get_rank(dp_group) if _dist_on() else 0
        self.tp_rank = tp_rank
        self.num_steps = 0

        self._offsets: list[int] = []
        offset = 0
        for t in locals_:
            self._offsets.append(offset)
            offset += t.numel()
        self.numel = offset
        self.padded_numel = -(-offset // self.dp_size) * self.dp_size
        if zero == 1:
            size = self.padded_numel // self.dp_size
            self.shard_start, self.shard_end = self.dp_rank * size, (self.dp_rank + 1) * size
        else:
            self.shard_start, self.shard_end = 0, self.padded_numel
        shard_numel = self.shard_end - self.shard_start

        replicated = {id(p) for p in tp_replicated}
        unknown = replicated - {id(p) for p in self.params}
        if unknown:
            raise ValueError(f"{len(unknown)} tp_replicated tensors are not among params")
        counted = [id(p) not in replicated or tp_rank == 0 for p in self.params]
        # Shard-relative ranges of the elements this rank counts in the norm, merged.
        self._norm_ranges: list[tuple[int, int]] = []
        if zero == 1 or self.dp_rank == 0:
            for (lo, hi), keep in zip(self._shard_overlaps(), counted, strict=True):
                if not keep or lo >= hi:
                    continue
                if self._norm_ranges and self._norm_ranges[-1][1] == lo:
                    self._norm_ranges[-1] = (self._norm_ranges[-1][0], hi)
                else:
                    self._norm_ranges.append((lo, hi))

        fp32 = dict(dtype=torch.float32, device=self.device)
        self._grad_buf = torch.zeros(self.padded_numel, **fp32)
        self._grad_shard: torch.Tensor | None = None
        self.exp_avg = torch.zeros(shard_numel, **fp32)
        self.exp_avg_sq = torch.zeros(shard_numel, **fp32)
        chunk = min(max(shard_numel, 1), _CHUNK)      # the per-chunk temporaries (_CHUNK)
        self._scratch32 = torch.empty(chunk, **fp32)
        self._scratch64 = torch.empty(chunk, dtype=torch.float64, device=self.device)
        # fp32 params are their own master copy; lower precision keeps an fp32 shard.
        self.master: torch.Tensor | None = None
        if self.dtype != torch.float32:
            self.master = torch.zeros(shard_numel, **fp32)
            self._read_param_shard(self.master)
        # The parameters become views into one flat buffer in this layout, so the update
        # writes this rank's shard in place and the all-gather lands in the parameters
        # themselves: no per-step copy of every parameter out and back (DTensor
        # parameters keep their own storage and take that copy).
        self._flat: torch.Tensor | None = None
        if all(local_tensor(p) is p for p in self.params):
            flat = torch.zeros(self.padded_numel, dtype=self.dtype, device=self.device)
            with torch.no_grad():
                for p, off in zip(self.params, self._offsets, strict=True):
                    view = flat[off:off + p.numel()]
                    view.copy_(p.reshape(-1))
                    p.data = view.view_as(p)
            self._flat = flat

    # -- layout -------------------------------------------------------------------------

    def _shard_overlaps(self) -> list[tuple[int, int]]:
        """Per parameter, the shard-relative [lo, hi) of its elements inside this shard."""
        out = []
        for p, off in zip(self.params, self._offsets, strict=True):
            lo = max(off, self.shard_start)
            hi = min(off + local_tensor(p).numel(), self.shard_end)
            out.append((lo - self.shard_start, max(lo, hi) - self.shard_start))
        return out

    @torch.no_grad()
    def _read_param_shard(self, out: torch.Tensor) -> None:
        out.zero_()
        for p, off, (lo, hi) in zip(self.params, self._offsets, self._shard_overlaps(),
                                    strict=True):
            if lo < hi:
                src = local_tensor(p).reshape(-1)
                base = self.shard_start - off
                out[lo:hi].copy_(src[lo + base:hi + base])

    # -- phase (a): gradients -------------------------------------------------------------

    @torch.no_grad()
    def reduce_grads(self, grad_scale: float = 1.0) -> None:
        """Flatten the ``.grad`` of the parameters (missing grads count as zero), multiply
        by ``grad_scale`` (a loss normalisation factor, e.g. 1 / num_microbatches) and by
        ``1 / dp`` when averaging, then sum over the DP group; this rank keeps its shard."""
        buf = self._grad_buf    # its padding is never written, so it stays zero
        if all(p.grad is not None for p in self.params):
            # One copy kernel for all of them, not one per parameter.
            torch.cat([_local_grad(p.grad).reshape(-1) for p in self.params],
                      out=buf[:self.numel])
        else:
            for p, off in zip(self.params, self._offsets, strict=True):
                n = local_tensor(p).numel()
                if p.grad is None:
                    buf[off:off + n].zero_()
                else:
                    buf[off:off + n].copy_(_local_grad(p.grad).reshape(-1))
        scale = grad_scale / self.dp_size if self.average else grad_scale
        if scale != 1.0:
            buf.mul_(scale)
        if self.dp_size == 1:
            self._grad_shard = buf
        elif self.zero == 1 and _uses_nccl(self.dp_group, buf.device):
            shard = torch.empty(self.shard_end - self.shard_start, dtype=buf.dtype,
                                device=buf.device)
            dist.reduce_scatter_tensor(shard, buf, op=dist.ReduceOp.SUM, group=self.dp_group)
            self._grad_shard = shard
        else:
            dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.dp_group)
            self._grad_shard = buf[self.shard_start:self.shard_end]

    def _require_grads(self) -> torch.Tensor:
        if self._grad_shard is None:
            raise RuntimeError("call reduce_grads() before this")
        return self._grad_shard

    def local_nonfinite(self) -> bool:
        """True when this rank's reduced gradient shard holds an inf or NaN."""
        return not bool(torch.isfinite(self._require_grads()).all())

    def grad_sq_norm_and_nonfinite(self) -> tuple[float, bool]:
        """``(grad_sq_norm(), local_nonfinite())`` in one pass over the shard where the
        norm ranges cover all of it (the common case), else in two."""
        g = self._require_grads()
        if self._norm_ranges == [(0, g.numel())]:
            sq = _sq_norm(g, self._scratch64)
            return sq, not math.isfinite(sq)
        return self.grad_sq_norm(), self.local_nonfinite()

    def grad_sq_norm(self) -> float:
        """This rank's contribution to the squared global gradient norm (module rule)."""
        g = self._require_grads()
        return sum(_sq_norm(g[lo:hi], self._scratch64) for lo, hi in self._norm_ranges)

    # -- phases (b) and (c): update and gather ------------------------------------------

    @torch.no_grad()
    def apply(self, clip_coef: float = 1.0) -> None:
        """AdamW on this rank's shard with the reduced gradient times ``clip_coef``, then
        all-gather the updated shards into the parameters."""
        grad = self._require_grads()
        if clip_coef != 1.0:
            grad.mul_(clip_coef)    # our own buffer, refilled by the next reduce_grads
        if self.master is not None:
            param = self.master
        elif self._flat is not None:
            param = self._flat[self.shard_start:self.shard_end]     # the parameters
        else:
            param = torch.empty_like(self.exp_avg)
            self._read_param_shard(param)
        self.num_steps += 1
        beta1, beta2 = self.betas
        # The order and form of torch.optim.adam._single_tensor_adam (decoupled decay).
        param.mul_(1 - self.lr * self.weight_decay)
        self.exp_avg.lerp_(grad, 1 - beta1)
        self.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1 ** self.num_steps
        bias_correction2 = 1 - beta2 ** self.num_steps
        step_size = self.lr / bias_correction1
        root = math.sqrt(bias_correction2)
        for lo in range(0, param.numel(), _CHUNK):   # the denominator a chunk at a time
            hi = min(lo + _CHUNK, param.numel())
            denom = self._scratch32[:hi - lo]
            torch.sqrt(self.exp_avg_sq[lo:hi], out=denom)
            denom.div_(root).add_(self.eps)
            param[lo:hi].addcdiv_(self.exp_avg[lo:hi], denom, value=-step_size)
        self._grad_shard = None
        self._gather(param)

    @torch.no_grad()
    def _gather(self, shard_fp32: torch.Tensor) -> None:
        if self._flat is not None:
            mine = self._flat[self.shard_start:self.shard_end]
            if self.master is not None:
                mine.copy_(shard_fp32)
            if self.zero == 0 or self.dp_size == 1:
                return
            mine = mine.clone()     # the collective must not read what it writes
            if _uses_nccl(self.dp_group, mine.device):
                dist.all_gather_into_tensor(self._flat, mine, group=self.dp_group)
            else:
                dist.all_gather(list(self._flat.chunk(self.dp_size)), mine,
                                group=self.dp_group)
            return
        shard = shard_fp32.to(self.dtype)
        if self.zero == 0 or self.dp_size == 1:
            full = shard
        elif _uses_nccl(self.dp_group, shard.device):
            full = torch.empty(self.padded_numel, dtype=self.dtype, device=shard.device)
            dist.all_gather_into_tensor(full, shard, group=self.dp_group)
        else:
            full = torch.empty(self.padded_numel, dtype=self.dtype, device=shard.device)
            dist.all_gather(list(full.chunk(self.dp_size)), shard, group=self.dp_group)
        targets = [local_tensor(p) for p in self.params]
        sources = [chunk.view_as(t) for chunk, t in zip(
            full[:self.numel].split([t.numel() for t in targets]), targets, strict=True)]
        torch._foreach_copy_(targets, sources)

    def skip(self) -> None:
        """Drop the reduced gradients without touching parameters or state."""
        self._require_grads()
        self._grad_shard = None

    def step(self, grad_scale: float = 1.0, max_norm: float | None = None,
             world_group: Any = None) -> StepResult:
        """:func:`optimizer_step` for this optimizer alone (collective over the world)."""
        return optimizer_step([self], grad_scale=grad_scale, max_norm=max_norm,
                              world_group=world_group)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    # -- checkpoints ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state, as plain tensors and numbers."""
        state: dict[str, Any] = {
            "version": _STATE_VERSION,
            "num_steps": self.num_steps,
            "lr": self.lr, "betas": list(self.betas), "eps": self.eps,
            "weight_decay": self.weight_decay,
            "zero": self.zero, "dp_size": self.dp_size, "dp_rank": self.dp_rank,
            "numel": self.numel, "shard": [self.shard_start, self.shard_end],
            "param_shapes": [list(local_tensor(p).shape) for p in self.params],
            "exp_avg": self.exp_avg.detach().clone().cpu(),
            "exp_avg_sq": self.exp_avg_sq.detach().clone().cpu(),
        }
        if self.master is not None:
            state["master"] = self.master.detach().clone().cpu()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` taken with the same parameters, ZeRO stage and DP
        layout; the hyperparameters (lr, betas, eps, weight decay) are restored too."""
        mine = self.state_dict()
        for key in ("version", "zero", "dp_size", "dp_rank", "numel", "shard",
                    "param_shapes"):
            if state.get(key) != mine[key]:
                raise ValueError(f"optimizer state does not fit: {key} is {state.get(key)!r}"
                                 f", this optimizer has {mine[key]!r}")
        if ("master" in state) != (self.master is not None):
            raise ValueError("optimizer state and parameters disagree on fp32 master weights")
        self.num_steps = int(state["num_steps"])
        self.lr, self.eps = float(state["lr"]), float(state["eps"])
        self.betas = (float(state["betas"][0]), float(state["betas"][1]))
        self.weight_decay = float(state["weight_decay"])
        with torch.no_grad():
            self.exp_avg.copy_(state["exp_avg"])
            self.exp_avg_sq.copy_(state["exp_avg_sq"])
            if self.master is not None:
                self.master.copy_(state["master"])
        self._grad_shard = None


def local_grad_sq_norm(params: Iterable[torch.Tensor], *, tp_rank: int = 0,
                       tp_replicated: Iterable[torch.Tensor] = (), dp_rank: int = 0) -> float:
    """This rank's contribution to the squared global norm for parameters whose ``.grad``
    is already DP-reduced (whole on every DP replica): zero unless ``dp_rank == 0``; the
    ``tp_replicated`` parameters count only on TP rank 0; missing grads count as zero.
    ``Partial`` DTensor gradients are reduced first, a collective over their TP mesh, so
    every TP rank of the stage must call this with the same parameters."""
    replicated = {id(p) for p in tp_replicated}
    total = 0.0
    for p in params:
        if p.grad is None:
            continue
        g = _local_grad(p.grad)
        if dp_rank == 0 and (tp_rank == 0 or id(p) not in replicated):
            total += _sq_norm(g)
    return total


def global_grad_norm(local_sq_norm: float, world_group: Any = None) -> float:
    """``sqrt`` of the sum of every rank's squared-norm contribution (one all_reduce over
    ``world_group``, default: the whole job); every rank must call it."""
    if not _dist_on():
        return math.sqrt(local_sq_norm)
    t = torch.tensor([local_sq_norm], dtype=torch.float64, device=_scalar_device(world_group))
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=world_group)
    return math.sqrt(float(t.item()))


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """The factor ``torch.nn.utils.clip_grad_norm_`` multiplies the gradients by:
    ``max_norm / (total_norm + 1e-6)`` clamped to at most 1."""
    return min(max_norm / (total_norm + 1e-6), 1.0)


def found_nonfinite(local_flag: bool, world_group: Any = None) -> bool:
    """True on every rank when any rank passed ``True`` (one all_reduce MAX)."""
    if not _dist_on():
        return bool(local_flag)
    t = torch.tensor([1 if local_flag else 0], dtype=torch.int32,
                     device=_scalar_device(world_group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=world_group)
    return bool(t.item())


def optimizer_step(optimizers: Sequence[Zero1AdamW], *, grad_scale: float = 1.0,
                   max_norm: float | None = None, world_group: Any = None,
                   totals: Sequence[float] = ()) -> StepResult:
    """One job-wide optimizer step: reduce every optimizer's gradients, agree on inf/NaN
    (every rank skips together), compute the global norm, clip and update. Collective over
    ``world_group``: every rank calls it, with ``[]`` where it trains nothing.

    ``totals``: numbers (e.g. this rank's share of the step's losses) summed over the job
    in the same all-reduce as the norm (float64), returned as ``StepResult.totals``: a
    caller that needs such sums saves a collective of its own. Every rank passes as many."""
    for opt in optimizers:
        opt.reduce_grads(grad_scale)
    sq, bad = 0.0, False
    for opt in optimizers:
        o_sq, o_bad = opt.grad_sq_norm_and_nonfinite()
        sq, bad = sq + o_sq, bad or o_bad
    # The flag and the norm in one all_reduce(SUM) (module docstring); a non-finite
    # rank's norm may be inf/NaN, which only matters when the step is skipped anyway.
    sums = tuple(float(x) for x in totals)
    if _dist_on():
        t = torch.tensor([0.0 if bad else sq, 1.0 if bad else 0.0, *sums],
                         dtype=torch.float64, device=_scalar_device(world_group))
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=world_group)
        total_sq, flags, *rest = t.tolist()
        bad, sums = flags > 0, tuple(rest)
    else:
        total_sq = sq
    if bad:
        for opt in optimizers:
            opt.skip()
        return StepResult(skipped=True, grad_norm=math.inf, clip_coef=0.0, totals=sums)
    norm = math.sqrt(total_sq)
    coef = 1.0 if max_norm is None else clip_coefficient(norm, max_norm)
    for opt in optimizers:
        opt.apply(coef)
    return StepResult(skipped=False, grad_norm=norm, clip_coef=coef, totals=sums)
