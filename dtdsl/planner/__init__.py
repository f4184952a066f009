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
from dtdsl.ir.plan import BASELINES, Baseline, Plan, Simulated
from dtdsl.planner.baseline import (
    Candidate,
    baseline_candidates,
    choose_on_drawn_batches,
    plan_baseline,
)
from dtdsl.planner.exhaustive import MAX_GPUS as EXHAUSTIVE_MAX_GPUS
from dtdsl.planner.exhaustive import plan_exhaustive
from dtdsl.planner.orchestrate import plan_convex
from dtdsl.planner.result import Infeasible, PlannerError
from dtdsl.planner.simulated import (
    ESTIMATED,
    SIMULATED,
    SpecData,
    choose_plan,
    packing_figures,
    simulate_plan,
)

__all__ = ["EXHAUSTIVE_MAX_GPUS", "SEARCHES", "Infeasible", "PlannerError", "plan",
           "plan_baseline", "plan_baselines", "plan_convex", "plan_exhaustive",
           "simulate_plan"]

SEARCHES = ("convex", "exhaustive", "baseline")
Progress = Callable[[int, int, str], None]


def plan(cost: CostModel, num_gpus: int | None = None, *, search: str = "convex",
         compare_baseline: bool = True, progress: Progress | None = None,
         baseline_progress: Progress | None = None, simulate_steps: int = 0,
         estimate: int = ESTIMATED, simulate: int = SIMULATED) -> Plan:
    """Plan with ``search`` and, unless ``compare_baseline`` is off, the Megatron-LM
    baselines on the same cluster (``plan_baselines``: ``Plan.baselines``, each with the
    plan's speedup over it; a baseline no layout of which fits is left out).

    ``simulate_steps`` > 0: the objective is the time on that many drawn batches
    (``planner.simulated.choose_plan``): of the layouts near the search's optimum in
    expectation (up to ``estimate``, one per backbone layout), the ``simulate`` best by
    the drawn-batch estimate (``sim.estimate``) are simulated under the spec's reorder
    policy and the fastest is the plan; then that plan without reordering, and with
    ``train.packing`` toggled (``packing_figures``). The Plan's ``simulated`` holds the
    figures; the baselines are chosen on the same batches. ``search = "baseline"``: the
    plan is the ``megatron`` baseline itself. ``progress`` (``baseline_progress`` for the
    baselines, default ``progress``) is called as the work goes, each phase named in
    its note."""
    if search not in SEARCHES:
        raise ValueError(f"unknown search {search!r}; one of {', '.join(SEARCHES)}")
    steps = simulate_steps
    baseline_progress = baseline_progress or progress
    # The spec's data packed and unpacked, drawn once for the baselines and the packing
    # figures alike.
    data = SpecData(cost, max(steps, 1))
    baselines: dict[str, Baseline] | None = None
    if search == "baseline" or compare_baseline:
        baselines = plan_baselines(cost, num_gpus, steps=steps, data=data,
                                   progress=progress if search == "baseline" else
                                   baseline_progress)
    if search == "baseline":
        if "megatron" not in baselines:
            # Nothing fits: plan_baseline says why.
            plan_baseline(data.cost(False), num_gpus)
        chosen = baselines["megatron"]
        result = chosen.layout
        if steps > 0:
            assert chosen.simulated_s is not None
            result = result.model_copy(update={"simulated": Simulated(
                steps=steps, policy=(), iteration_time_s=chosen.simulated_s,
                no_reorder_iteration_time_s=chosen.simulated_s,
                candidates=chosen.candidates, estimated=chosen.estimated)})
        return _compared(result, baselines)
    planner = plan_convex if search == "convex" else plan_exhaustive
    result = planner(cost, num_gpus, progress=_named(progress, f"{search} search"))
    if steps <= 0:
        return _compared(result, baselines)
    policy = frozenset(cost.program.train.reorder)
    batches = data.batches(cost.program.train.packing)
    result, timed, scored, estimated = choose_plan(
        cost, result, batches, policy, estimate=estimate, simulate=simulate,
        progress=_named(progress, "drawn batches"))
    plain = timed if not policy else batches.mean_time(cost, result, frozenset())
    packing = packing_figures(cost, result, steps=steps, iteration_time_s=timed, data=data,
                              policy=policy)
    result = result.model_copy(update={"simulated": Simulated(
        steps=steps, policy=tuple(sorted(policy)), iteration_time_s=timed,
        no_reorder_iteration_time_s=plain, candidates=scored, estimated=estimated,
        packing=packing)})
    return _compared(result, baselines)


def _named(progress: Progress | None, phase: str) -> Progress | None:
    """``progress`` with each note prefixed by the phase it reports."""
    if progress is None:
        return None
    return lambda done, total, note: progress(done, total, f"{phase}: {note}")


def plan_baselines(cost: CostModel, num_gpus: int | None = None, *, steps: int = 0,
                   progress: Progress | None = None,
                   data: SpecData | None = None) -> dict[str, Baseline]:
    """Megatron-LM's two baselines on the cluster (``planner.baseline``): ``megatron``
    unpacked, ``megatron_packed`` packed, each the fastest of its candidates on the first
    ``steps`` drawn batches (the plan's, ``planner.simulated``), or at mean work when
    ``steps`` is 0, with its positions a step over the plan's. Without the plan's
    speedups (``plan`` adds them). A baseline no layout of which fits is left out, and
    so is one whose packing differs from the spec's under a measured profile (it times
    whole sequences, not packed documents). ``data``: the spec's data both ways, where
    the caller has it."""
    data = data or SpecData(cost, max(steps, 1))
    spec_packs = cost.program.train.packing
    out: dict[str, Baseline] = {}
    total = 2 * len(BASELINES)
    for k, name in enumerate(BASELINES):
        packing = name == "megatron_packed"
        if cost.profile is not None and packing != spec_packs:
            continue

        def part(done: int, of: int, note: str, at: int = 2 * k, name: str = name) -> None:
            if progress is not None:
                progress(at * max(of, 1) + done, total * max(of, 1), f"{name}: {note}")

        found = baseline_candidates(data.cost(packing), num_gpus, progress=part,
                                    samples=data.reference(packing))
        if not found:
            continue
        chosen: Candidate = found[0]
        simulated, count, estimated = None, 1, 0
        if steps > 0:
            chosen, simulated, count, estimated = choose_on_drawn_batches(
                found, data.batches(packing),
                lambda done, of, note, at=2 * k + 1, name=name: part(done, of, note, at, name))
        # Positions a step, the baseline's over the plan's: 1 on the same data.
        ratio = simulated_ratio = 1.0
        if packing != spec_packs:
            ratio = data.expected_positions(packing) / data.expected_positions(spec_packs)
            if steps > 0:
                simulated_ratio = data.batches(packing).positions / \
                    data.batches(spec_packs).positions
        out[name] = Baseline(packing=packing, layout=chosen.plan,
                             planned_s=chosen.plan.iteration_time_s, simulated_s=simulated,
                             steps=max(steps, 0), candidates=count, estimated=estimated,
                             positions_ratio=ratio,
                             simulated_positions_ratio=simulated_ratio)
    return out


def _compared(result: Plan, baselines: dict[str, Baseline] | None) -> Plan:
    """``result`` with ``baselines`` and its speedup over each, per position
    (``Baseline.positions_ratio``: a baseline packed where the spec is not, or the
    reverse, trains more or fewer positions a step)."""
    if baselines is None:
        return result
    sim = result.simulated
    out = {}
    for name, base in baselines.items():
        speedup = base.planned_s / result.iteration_time_s / base.positions_ratio
        simulated_speedup = None
        if base.simulated_s is not None and sim is not None:
            simulated_speedup = base.simulated_s / sim.iteration_time_s / \
                base.simulated_positions_ratio
        out[name] = base.model_copy(update={"speedup": speedup,
                                            "simulated_speedup": simulated_speedup})
    return result.model_copy(update={"baselines": out})
