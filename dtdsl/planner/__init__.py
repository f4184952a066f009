"""dtdsl.planner: how many GPUs each unit gets and its TP/DP/PP (see docs/architecture.md).

Three searches over the same exact evaluator (``evaluate.Evaluator``):

- ``convex``: DistTrain's Algorithm 1, a convex program per TP/DP candidate inside a
  branch and bound (``orchestrate``);
- ``exhaustive``: every integer layout, the reference for clusters up to 128 GPUs;
- ``baseline``: Megatron-LM's rigid layout, what every comparison is against.

The modules import cvxpy (a second to load), so import this package only to plan.
"""

from __future__ import annotations

from collections.abc import Callable

from dtdsl.cost.model import CostModel
from dtdsl.ir.plan import Plan
from dtdsl.planner.baseline import plan_baseline
from dtdsl.planner.exhaustive import MAX_GPUS as EXHAUSTIVE_MAX_GPUS
from dtdsl.planner.exhaustive import plan_exhaustive
from dtdsl.planner.orchestrate import plan_convex
from dtdsl.planner.result import Infeasible, PlannerError

__all__ = ["EXHAUSTIVE_MAX_GPUS", "SEARCHES", "Infeasible", "PlannerError", "plan",
           "plan_baseline", "plan_convex", "plan_exhaustive"]

SEARCHES = ("convex", "exhaustive", "baseline")
Progress = Callable[[int, int, str], None]


def plan(cost: CostModel, num_gpus: int | None = None, *, search: str = "convex",
         compare_baseline: bool = True, progress: Progress | None = None,
         baseline_progress: Progress | None = None) -> Plan:
    """Plan with ``search`` and, unless it is the baseline itself or ``compare_baseline``
    is off, also plan the baseline on the same cluster so the Plan carries the speedup
    over it (left unset when no baseline layout fits)."""
    if search not in SEARCHES:
        raise ValueError(f"unknown search {search!r}; one of {', '.join(SEARCHES)}")
    if search == "baseline":
        return plan_baseline(cost, num_gpus, progress=progress)
    planner = plan_convex if search == "convex" else plan_exhaustive
    result = planner(cost, num_gpus, progress=progress)
    if not compare_baseline:
        return result
    try:
        baseline = plan_baseline(cost, num_gpus, progress=baseline_progress)
    except Infeasible:
        return result
    return result.model_copy(update={"baseline_iteration_time_s": baseline.iteration_time_s})
