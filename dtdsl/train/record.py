"""What one training step of a rank gives back (``StageExecutor.run_step``): its losses,
norm, fp16 scale, time and measured actions, as the launcher logs them and the tests and
benchmarks read them."""

from __future__ import annotations

from typing import TypedDict

from dtdsl.ir.timeline import Event

__all__ = ["StepRecord"]


class StepRecord(TypedDict):
    """What ``StageExecutor.run_step`` returns for one training step. Losses are summed
    over the job (identical on every rank)."""

    step: int
    loss: float                 # lm_loss + gen_loss
    lm_loss: float
    gen_loss: float
    grad_norm: float            # the job's, before clipping (``train.optim``)
    skipped: bool               # fp16: the step was skipped (an inf/nan gradient)
    loss_scale: float | None    # fp16: the scale the step ran with; else None
    skipped_steps: int | None   # fp16: steps skipped so far; else None
    time_s: float
    data_wait_s: float          # waiting for this step's batch
    events: list[Event]         # this rank's measured actions
    processed: dict[str, int]   # patches, positions, text tokens and targets it ran
    dp_sync_bytes: int          # bytes the job put into data-parallel collectives
    compiled_graphs: int        # graphs its compiled blocks compiled so far; 0 eager
