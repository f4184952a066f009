"""The optimizer step of a job: torch's (fused) AdamW on each stage's FSDP2 shards, with a
job-wide gradient norm, clipping and inf/NaN skip.

Every rank of the job calls :func:`optimizer_step` once per training step, after its
stage's last backward (FSDP2 has reduce-scattered the gradients in fp32 by then), with
the optimizer of its stage (or none: a frozen generator trains nothing, and still takes
part). One ``all_reduce(SUM)`` over the whole job carries, in float64:

* the squared gradient norm of every element of the job counted once (below),
* an inf/NaN flag (positive when any rank saw a non-finite gradient),
* whatever ``totals`` the caller wants summed over the job (the executor's losses),

after which every rank agrees whether to skip the step (a non-finite gradient anywhere
skips it everywhere, as Megatron's MIMO optimizer does), and by how much to scale the
gradients (``grad_clip``, as ``torch.nn.utils.clip_grad_norm_``).

**Counting every gradient element once.** A gradient is a DTensor (FSDP2's shard over the
DP ranks, with a TP placement for TP-sharded parameters) or, off a mesh, a plain tensor.
Its local block is distinct data along every mesh dimension where its placement is a
``Shard`` and a copy along every ``Replicate`` one: it counts on the ranks whose
coordinate is 0 along its replicate dimensions. A parameter that is not TP-sharded lives on
the DP mesh only and is the same on every TP rank of the stage (its gradient averaged over
TP at the end of the step, ``train.stage.Stage.reduce_gradients``, so every TP rank takes
the same step): it counts on TP index 0 (``counted_on_tp``). A ``Partial`` gradient (a
sequence-parallel norm's) is summed over its TP group by FSDP2 before its reduce-scatter;
one reaching the optimizer is an error.

**Dynamic loss scaling** (``precision = fp16``; ``LossScale``): every backward of the job
runs on the loss times the scale (the executor seeds each loss's backward with the
scale, so every gradient of the pipeline and across the broker is scaled alike), and
this step unscales: the norm is the scaled norm over the scale, and the clipping factor
over the scale multiplies the gradients in the one pass that clipping already makes
(the scale a power of two, this is bitwise ``unscale_`` then clipping). The non-finite
flag of the one all-reduce above is the scaler's ``found_inf``, agreed over every rank
of the job, so every unit and stage skips together; the scale then halves, and after
``growth_interval`` good steps in a row it doubles: ``torch.amp.GradScaler``'s rule and
defaults. torch's ``ShardedGradScaler`` is not used: its ``unscale_`` all-reduces a flag
per optimizer over one group, which a rank with no optimizer (a frozen generator) or two
(a stage and a phased encoder) cannot match, and it would add a collective per step to the
one this step already makes. As in Megatron-LM, a skipped step does not advance the
learning-rate schedule: the optimizer step ``step - skipped_steps`` takes its rate.

The optimizer is ``torch.optim.AdamW`` (``Adam`` for ``adam``), fused where the device has a
fused kernel, over the DTensor parameters: FSDP2's fp32 shards, so master weights and both
moments are fp32 and sharded over DP (ZeRO-1's optimizer memory). The learning rate is set
every step from the spec's schedule (``train.lr``): nothing about it lives in optimizer
state, so a resumed run continues on the same curve. The parameters are in param groups of
``GROUP_PARAMS``, all with the same settings: DTensor works out the shardings of a
multi-tensor op in time quadratic in its number of tensors, which made the first step of a
stage of hundreds of parameters (a U-Net's) take seconds of CPU; each parameter's update is
the same in any grouping, and checkpoints keep the state per parameter, not the groups.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dtdsl.train.offload import OffloadAdam, OffloadAdamW

__all__ = ["GROUP_PARAMS", "LossScale", "StageOptimizer", "StepResult", "clip_coefficient",
           "optimizer_step"]

# The largest scale: GradScaler keeps its scale in fp32 and grows it only to a finite one.
_MAX_SCALE = torch.finfo(torch.float32).max

GROUP_PARAMS = 32
"""Parameters per optimizer param group (module docstring)."""


@dataclass(frozen=True)
class StepResult:
    grad_norm: float            # before clipping; inf/nan when a gradient was
    skipped: bool               # a non-finite gradient somewhere: nobody stepped
    totals: tuple[float, ...]   # the caller's totals, summed over the job


@dataclass
class LossScale:
    """The dynamic loss scale of an fp16 job (module docstring), the same on every rank:
    ``torch.amp.GradScaler``'s update rule and defaults (``init_scale`` 2**16, growth
    2.0, backoff 0.5, interval 2000). ``growth_tracker``: good steps since the scale last
    changed; ``skipped_steps``: steps skipped so far (the learning-rate schedule's lag)."""

    scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    growth_tracker: int = 0
    skipped_steps: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"loss scale {self.scale}: it must be positive and finite")
        if not self.growth_factor > 1.0 or not 0.0 < self.backoff_factor < 1.0:
            raise ValueError(f"growth factor {self.growth_factor} and backoff factor "
                             f"{self.backoff_factor}: the growth must exceed 1, the "
                             "backoff lie between 0 and 1")
        if self.growth_interval < 1:
            raise ValueError(f"growth interval {self.growth_interval}: at least 1")
        if not 0 <= self.growth_tracker < self.growth_interval or self.skipped_steps < 0:
            raise ValueError(f"growth tracker {self.growth_tracker} (of an interval of "
                             f"{self.growth_interval}) and {self.skipped_steps} skipped "
                             "steps: neither can be negative, the tracker is below the "
                             "interval")

    def update(self, found_inf: bool) -> None:
        """After a step: ``torch._amp_update_scale_``'s rule (a skipped step backs off
        and restarts the count; the interval's good step grows the scale if it stays
        finite in fp32)."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            self.skipped_steps += 1
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            grown = self.scale * self.growth_factor
            if grown <= _MAX_SCALE:
                self.scale = grown
            self.growth_tracker = 0

    def state(self) -> dict[str, float | int]:
        """What a checkpoint keeps (the factors and the interval are the defaults')."""
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "skipped_steps": self.skipped_steps}


def clip_coefficient(norm: float, max_norm: float | None) -> float:
    """``clip_grad_norm_``'s factor: ``min(1, max_norm / (norm + 1e-6))``."""
    if max_norm is None or max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))


def _reduced(g: Any) -> Any:
    """``g``, checked to hold whole sums: FSDP2 reduces a ``Partial`` gradient (a sequence-
    parallel norm's) over its TP group before its reduce-scatter. Reducing one here would
    be a collective on only the ranks that have that gradient: refuse instead."""
    placements = getattr(g, "placements", None)
    if placements is not None and any(pl.is_partial() for pl in placements):
        raise RuntimeError(f"a Partial gradient ({placements}) reached the optimizer: its "
                           "sum over the TP group was not taken")
    return g


def _counts_here(g: Any) -> bool:
    """Whether this rank's block of gradient ``g`` is the one that counts (docstring)."""
    placements = getattr(g, "placements", None)
    if placements is None:
        return True
    mesh = g.device_mesh
    coords = mesh.get_coordinate()
    return all(c == 0 for c, pl in zip(coords, placements, strict=True) if pl.is_replicate())


def _local(t: Any) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class StageOptimizer:
    """The spec's optimizer over one stage's trainable parameters.

    ``counted_on_tp``: per parameter, whether it is TP-sharded (counts on every TP rank)
    rather than replicated over TP (counts on TP index 0 only); ``tp_index``: this rank's;
    ``uncounted``: per parameter, whether it is a copy counted elsewhere (a tied LM head on
    a backbone's last stage: its first stage counts the embedding). ``lr_at``: the
    learning rate of an optimizer step (0-based). ``offload``: the fraction of the
    parameters' state and update on the CPU (``train.offload``)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], *, name: str, lr: float,
                 betas: tuple[float, float], eps: float, weight_decay: float,
                 tp_index: int = 0, counted_on_tp: Sequence[bool] | None = None,
                 uncounted: Sequence[bool] | None = None,
                 lr_at: Callable[[int], float] | None = None, offload: float = 0.0):
        self.params = list(params)
        if not self.params:
            raise ValueError("an optimizer needs parameters (pass none to optimizer_step "
                             "for a stage that trains nothing)")
        if name not in ("adamw", "adam"):
            raise ValueError(f"optimizer {name!r}: the runtime has adamw and adam")
        device = _local(self.params[0]).device
        groups = [{"params": self.params[i:i + GROUP_PARAMS]}
                  for i in range(0, len(self.params), GROUP_PARAMS)]
        settings = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                    **_kernel(device)}
        if offload > 0:
            # The fraction ``offload`` of the state and update on the CPU (train.offload).
            cls = OffloadAdamW if name == "adamw" else OffloadAdam
            self.optimizer = cls(groups, offload=offload,
                                 host_kernel=_kernel(torch.device("cpu")), **settings)
        else:
            cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
            self.optimizer = cls(groups, **settings)
        self.lr_at = lr_at if lr_at is not None else (lambda _step: lr)
        flags = [True] * len(self.params) if counted_on_tp is None else list(counted_on_tp)
        if len(flags) != len(self.params):
            raise ValueError("counted_on_tp needs one flag per parameter")
        copies = [False] * len(self.params) if uncounted is None else list(uncounted)
        if len(copies) != len(self.params):
            raise ValueError("uncounted needs one flag per parameter")
        self._counted_tp = [(f or tp_index == 0) and not c for f, c in zip(flags, copies,
                                                                          strict=True)]

    def grad_sq_norm_and_nonfinite(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's share of the job's squared gradient norm, whether any of its
        local gradients is non-finite), float64 scalars on the device: one foreach norm
        over the gradients that count here and one over the copies, no host read."""
        counted: list[torch.Tensor] = []
        copies: list[torch.Tensor] = []
        for p, on_tp in zip(self.params, self._counted_tp, strict=True):
            if p.grad is None:
                continue
            g = _reduced(p.grad)
            (counted if on_tp and _counts_here(g) else copies).append(_local(g).detach())
        device = _local(self.params[0]).device
        sq = _sum_of_squares(counted, device)
        bad = (~torch.isfinite(sq + _sum_of_squares(copies, device))).double()
        return sq, bad

    def step(self, step: int, coefficient: float) -> None:
        """Scale the gradients by ``coefficient`` and take optimizer step ``step`` (at the
        schedule's rate for ``step``)."""
        grads = [_local(p.grad) for p in self.params if p.grad is not None]
        if coefficient != 1.0 and grads:
            torch._foreach_mul_(grads, coefficient)
        lr = self.lr_at(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


def _sum_of_squares(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of the squares of every element of ``tensors``, float64, on ``device``
    (inf or nan where an element is): each tensor's norm in one foreach kernel,
    accumulated in fp32 as ``clip_grad_norm_`` does, squared and summed in float64."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
    return torch.stack(norms).double().square().sum()


def _kernel(device: torch.device) -> dict[str, bool]:
    # The fused kernels take the whole update in one launch (CUDA) or one pass (CPU).
    try:
        from torch.optim.optimizer import _get_fused_kernels_supported_devices

        if device.type in _get_fused_kernels_supported_devices():
            return {"fused": True}
    except ImportError:     # pragma: no cover - older torch
        pass
    return {"foreach": True}


def optimizer_step(optimizers: Sequence[StageOptimizer], *, step: int,
                   max_norm: float | None, totals: Sequence[torch.Tensor | float] = (),
                   device: torch.device | str = "cpu",
                   loss_scale: LossScale | None = None) -> StepResult:
    """The job's optimizer step (module docstring). Collective over every rank of the
    default group when torch.distributed is initialised. ``totals``: scalars to sum over
    the job, best as tensors on ``device`` (the step's losses, never read on the host
    before this): the message is built on the device and read back once, after its
    all-reduce, the step's one host read. ``loss_scale``: the scale the step's backwards
    ran with (fp16), unscaled here and updated after the step, the same on every rank."""
    device = torch.device(device)
    sq = torch.zeros((), dtype=torch.float64, device=device)
    bad = torch.zeros((), dtype=torch.float64, device=device)
    for opt in optimizers:
        s, b = opt.grad_sq_norm_and_nonfinite()
        sq, bad = sq + s.to(device), torch.maximum(bad, b.to(device))
    parts = [sq, bad] + [torch.as_tensor(t, dtype=torch.float64).to(device).reshape(())
                         for t in totals]
    message = torch.stack(parts)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(message)
    values = message.tolist()
    inv_scale = 1.0 if loss_scale is None else 1.0 / loss_scale.scale
    norm = math.sqrt(values[0]) * inv_scale if values[0] >= 0 else float("nan")
    skipped = values[1] > 0 or not math.isfinite(norm)
    if skipped:
        norm = float("nan") if not math.isinf(values[0]) else float("inf")
        for opt in optimizers:
            opt.zero_grad()
    else:
        # Unscaling and clipping in one multiplication of the scaled gradients.
        coefficient = clip_coefficient(norm, max_norm) * inv_scale
        lr_step = step if loss_scale is None else step - loss_scale.skipped_steps
        for opt in optimizers:
            opt.step(lr_step, coefficient)
            opt.zero_grad()
    if loss_scale is not None:
        loss_scale.update(skipped)
    return StepResult(grad_norm=norm, skipped=skipped, totals=tuple(values[2:]))
