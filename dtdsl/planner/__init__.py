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
from dtdsl.ir.plan import Plan, Simulated
from dtdsl.planner.baseline import plan_baseline
from dtdsl.planner.exhaustive import MAX_GPUS as EXHAUSTIVE_MAX_GPUS
from dtdsl.planner.exhaustive import plan_exhaustive
from dtdsl.planner.orchestrate import convex_alternatives, plan_convex
from dtdsl.planner.result import Infeasible, PlannerError
from dtdsl.planner.simulated import packing_figures, simulate_plan

__all__ = ["EXHAUSTIVE_MAX_GPUS", "SEARCHES", "Infeasible", "PlannerError", "plan",
           "plan_baseline", "plan_convex", "plan_exhaustive", "simulate_plan"]

SEARCHES = ("convex", "exhaustive", "baseline")
Progress = Callable[[int, int, str], None]


def plan(cost: CostModel, num_gpus: int | None = None, *, search: str = "convex",
         compare_baseline: bool = True, progress: Progress | None = None,
         baseline_progress: Progress | None = None, simulate_steps: int = 0,
         alternatives: int = 3) -> Plan:
    """Plan with ``search`` and, unless it is the baseline itself or ``compare_baseline``
    is off, also plan the baseline on the same cluster so the Plan carries the speedup
    over it (left unset when no baseline layout fits).

    ``simulate_steps`` > 0: score on that many drawn batches (``planner.simulated``): the
    convex search's plan and up to ``alternatives`` runners-up in expectation
    (``orchestrate.convex_alternatives``) under the spec's reorder policy, keeping the
    fastest there; then that plan without reordering and the baseline without, and that
    plan with ``train.packing`` toggled (``packing_figures``). The Plan's ``simulated``
    holds the figures."""
    if search not in SEARCHES:
        raise ValueError(f"unknown search {search!r}; one of {', '.join(SEARCHES)}")
    if search == "baseline":
        result = plan_baseline(cost, num_gpus, progress=progress)
        baseline = result
    else:
        planner = plan_convex if search == "convex" else plan_exhaustive
        result = planner(cost, num_gpus, progress=progress)
        baseline = None
        if compare_baseline:
            try:
                baseline = plan_baseline(cost, num_gpus, progress=baseline_progress)
            except Infeasible:
                baseline = None
            else:
                result = result.model_copy(
                    update={"baseline_iteration_time_s": baseline.iteration_time_s})
    if simulate_steps <= 0:
        return result
    # Megatron-LM's rigid layout does not reorder.
    policy = frozenset() if result.rigid else frozenset(cost.program.train.reorder)
    steps = simulate_steps
    timed = simulate_plan(cost, result, policy=policy, steps=steps)
    scored = 1
    if search == "convex" and alternatives > 0:
        # Stragglers in the objective: the runners-up in expectation, scored on the same
        # drawn batches; the fastest there is the plan.
        for other in convex_alternatives(cost, num_gpus, result, count=alternatives):
            scored += 1
            t = simulate_plan(cost, other, policy=policy, steps=steps)
            if t < timed:
                timed = t
                result = other.model_copy(update={
                    k: getattr(result, k) for k in ("solve_time_s", "candidates",
                                                    "convex_solves", "evaluated",
                                                    "baseline_iteration_time_s")})
    plain = timed if not policy else simulate_plan(cost, result, policy=frozenset(),
                                                   steps=steps)
    base = None
    if baseline is not None:
        base = plain if baseline is result else simulate_plan(
            cost, baseline, policy=frozenset(), steps=steps)
    packing = packing_figures(cost, result, steps=steps, iteration_time_s=plain)
    return result.model_copy(update={"simulated": Simulated(
        steps=steps, policy=tuple(sorted(policy)), iteration_time_s=timed,
        no_reorder_iteration_time_s=plain, baseline_iteration_time_s=base,
        candidates=scored, packing=packing)})
