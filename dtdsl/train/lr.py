"""The learning rate at each training step: ``train.lr_schedule`` of a spec.

A schedule (``ir.LRSchedule``) scales the optimizer's peak ``lr``. With ``s`` the 0-based
training step, ``N`` the spec's ``train.steps``, ``W`` the warmup and ``m`` the schedule's
``min_lr`` (torchtitan's and Megatron-LM's shapes):

- warmup, ``s < W``: ``lr * (s + 1) / W``, so the first step runs at ``lr / W`` and step
  ``W - 1`` at the peak;
- then ``constant``: ``lr``;
- ``linear``: ``m + (lr - m) * (1 - p)``;
- ``cosine``: ``m + (lr - m) * 0.5 * (1 + cos(pi * p))``;

with the decay's progress ``p = (s - W) / max(1, N - W)`` clamped to ``[0, 1]``. The decay
starts at the peak at step ``W`` and reaches ``m`` at step ``N``, the step after the last
one trained, so the last step still learns when ``min_lr`` is 0; later steps stay at ``m``.

``lr_at`` is ``peak_lr * lr_factor``, the very product ``torch.optim.lr_scheduler.LambdaLR``
forms from ``lr_lambda``, so the two give bit-identical rates and a runtime may use either.
The horizon ``N`` is the spec's ``train.steps`` even when a run is told to stop earlier
(``--steps``), so a short run follows the start of the full run's curve.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from dtdsl.ir.program import LRSchedule

__all__ = ["lr_at", "lr_factor", "lr_lambda"]


def _check(schedule: LRSchedule, peak_lr: float, steps: int) -> None:
    if not (math.isfinite(peak_lr) and peak_lr > 0):
        raise ValueError(f"peak_lr must be a positive number, not {peak_lr!r}")
    if steps < 1:
        raise ValueError(f"steps must be at least 1, not {steps}")
    if schedule.warmup < 0:
        raise ValueError(f"warmup must be at least 0, not {schedule.warmup}")
    if not 0 <= schedule.min_lr <= peak_lr:
        raise ValueError(f"min_lr {schedule.min_lr!r} must lie in [0, peak_lr={peak_lr!r}]")


def _factor(schedule: LRSchedule, min_factor: float, steps: int, step: int) -> float:
    if step < 0:
        raise ValueError(f"step must be at least 0, not {step}")
    warmup = schedule.warmup
    if step < warmup:
        return (step + 1) / warmup
    if schedule.name == "constant":
        return 1.0
    progress = min(max((step - warmup) / max(1, steps - warmup), 0.0), 1.0)
    if schedule.name == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_factor + (1.0 - min_factor) * shape


def lr_factor(schedule: LRSchedule, peak_lr: float, steps: int, step: int) -> float:
    """The learning rate of 0-based training step ``step`` as a fraction of ``peak_lr``
    (the optimizer's ``lr``), for a run of ``steps`` steps (``train.steps``).

    ValueError for a step below 0, fewer than 1 steps, a peak that is not positive or a
    ``min_lr`` outside ``[0, peak_lr]``."""
    _check(schedule, peak_lr, steps)
    return _factor(schedule, schedule.min_lr / peak_lr, steps, step)


def lr_at(schedule: LRSchedule, peak_lr: float, steps: int, step: int) -> float:
    """The learning rate of 0-based training step ``step``: ``peak_lr * lr_factor(...)``
    (see the module docstring for the formula)."""
    return peak_lr * lr_factor(schedule, peak_lr, steps, step)


def lr_lambda(schedule: LRSchedule, peak_lr: float, steps: int) -> Callable[[int], float]:
    """A function of the step for ``torch.optim.lr_scheduler.LambdaLR``: over an optimizer
    whose ``lr`` is ``peak_lr``, ``LambdaLR(opt, lr_lambda(...))`` sets step ``s``'s rate to
    ``lr_at(..., s)`` exactly when ``scheduler.step()`` follows each ``optimizer.step()``.

    The arguments are checked now, not at the first step."""
    _check(schedule, peak_lr, steps)
    min_factor = schedule.min_lr / peak_lr

    def factor(step: int) -> float:
        return _factor(schedule, min_factor, steps, step)

    return factor
