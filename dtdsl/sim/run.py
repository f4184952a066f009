"""Simulate training steps of a plan: draw each global batch, route it under a reorder
policy, and simulate the lowered schedule with the durations of those samples."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from dtdsl.cost.model import CostModel
from dtdsl.cost.samples import SampleSet
from dtdsl.ir.plan import Plan
from dtdsl.ir.program import Program
from dtdsl.ir.schedule import Schedule
from dtdsl.reorder.workload import Routing, WorkModel, batch_samples, imbalance, model_flops, route
from dtdsl.sim.simulate import SimResult, Simulator
from dtdsl.sim.workload import iteration_durations

__all__ = ["StepResult", "simulate_routed", "simulate_steps"]


@dataclass(frozen=True)
class StepResult:
    """One simulated training step."""

    step: int
    result: SimResult
    iteration_time_s: float
    bubble_fraction: float        # over every stage replica (TensorBoard's
                                  # pipeline/bubble_fraction)
    mfu: float
    imbalance: float              # slowest replica over the mean, worst unit (1.0 balanced)

    def scalars(self) -> dict[str, float]:
        return {"mfu": self.mfu, "data/imbalance": self.imbalance}


def simulate_steps(program: Program, cost: CostModel, plan: Plan, schedule: Schedule, *,
                   steps: int, policy: frozenset[str], first_step: int = 0,
                   progress: Callable[[int], None] | None = None,
                   simulator: Simulator | None = None,
                   work_model: WorkModel | None = None) -> Iterator[StepResult]:
    """Simulate ``steps`` training steps (global batches ``first_step``...), each on its
    own batch of samples drawn from the spec's data, routed under ``policy`` (a subset of
    {"intra", "inter"}) by ``route``, the rule the workers feeding a run apply. A caller
    simulating the same schedule again (e.g. without reordering, to compare) passes the
    ``simulator`` and ``work_model`` of the first run rather than compiling and drawing
    references twice."""
    simulator = simulator or Simulator(schedule)
    work_model = work_model or WorkModel(cost)
    for step in range(first_step, first_step + steps):
        samples = batch_samples(program, step)
        work = work_model.relative(samples)
        routing = route(plan, work, policy)
        result = simulator.run(iteration_durations(plan, cost, schedule, routing, work))
        yield _step_result(step, result, plan, cost, work_model, samples, routing, work)
        if progress is not None:
            progress(step)


def _step_result(step: int, result: SimResult, plan: Plan, cost: CostModel,
                 work_model: WorkModel, samples: SampleSet, routing: Routing,
                 work: dict[str, np.ndarray]) -> StepResult:
    t = result.iteration_time_s
    peak = plan.num_gpus * cost.peak_flops
    return StepResult(
        step=step, result=result, iteration_time_s=t,
        bubble_fraction=result.mean_bubble_fraction(),
        mfu=model_flops(plan, cost, work_model.relative(samples, timed=False)) / (t * peak)
        if t > 0 else 0.0,
        imbalance=imbalance(plan, routing, work))


def simulate_routed(cost: CostModel, plan: Plan, simulator: Simulator,
                    work_model: WorkModel, step: int, samples: SampleSet,
                    routing: Routing) -> StepResult:
    """Simulate one step of given samples routed as given (a run's own batch and routing,
    e.g. the runtime's: its predicted timeline next to the measured one)."""
    work = work_model.relative(samples)
    result = simulator.run(iteration_durations(plan, cost, simulator.schedule, routing, work))
    return _step_result(step, result, plan, cost, work_model, samples, routing, work)
