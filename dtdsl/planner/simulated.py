"""Plans scored on drawn batches: the planner's stragglers term.

The pipeline formula (``planner.evaluate``) prices mean work. Real batches are not mean:
an encoder replica with a step's largest images holds up the backbone's replicas it
feeds, and the reorder policy (``train.reorder``) removes part of that. ``simulate_plan``
runs the lowered schedule of a plan on ``steps`` global batches drawn from the spec's data
(the same batches for every plan: step k's draw is seeded by the spec's seed and k),
routed under a policy, and returns the mean iteration time; ``plan`` in this package
scores its best candidate layouts with it under the spec's policy and keeps the fastest,
and reports the chosen plan without reordering and the baseline on the same batches.
"""

from __future__ import annotations

from statistics import fmean

from dtdsl.cost.model import CostModel
from dtdsl.ir.plan import Plan

__all__ = ["simulate_plan"]


def simulate_plan(cost: CostModel, plan: Plan, *, policy: frozenset[str], steps: int) -> float:
    """The mean iteration time of ``plan`` over the first ``steps`` drawn global batches,
    routed under ``policy`` (a subset of {"intra", "inter"})."""
    from dtdsl.schedule.lower import lower
    from dtdsl.sim.run import simulate_steps

    if steps < 1:
        raise ValueError(f"steps must be at least 1, not {steps}")
    schedule = lower(plan, cost.program)
    return fmean(s.iteration_time_s for s in simulate_steps(
        cost.program, cost, plan, schedule, steps=steps, policy=policy))
