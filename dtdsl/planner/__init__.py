"""dtdsl.planner: how many GPUs each unit gets and its TP/DP/PP (see docs/architecture.md).

Three searches over the same exact evaluator (``evaluate.Evaluator``):

- ``convex``: DistTrain's Algorithm 1, a convex program per TP/DP candidate inside a
  branch and bound (``orchestrate``);
- ``exhaustive``: every integer layout, the reference for clusters up to 128 GPUs;
- ``baseline``: Megatron-LM's rigid layout, what every comparison is against.

The modules import cvxpy (a second to load), so import this package only to plan.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from dtdsl.cost.model import CostModel
from dtdsl.ir import program as ir
from dtdsl.ir.plan import BASELINES, Baseline, Plan, Simulated
from dtdsl.planner.baseline import (
    Candidate,
    baseline_candidates,
    choose_on_drawn_batches,
    plan_baseline,
    with_recompute,
)
from dtdsl.planner.exhaustive import MAX_GPUS as EXHAUSTIVE_MAX_GPUS
from dtdsl.planner.exhaustive import plan_exhaustive
from dtdsl.planner.lighten import lightened
from dtdsl.planner.orchestrate import plan_convex
from dtdsl.planner.placement import PLACEMENTS, colocated_layouts, colocation_refusal
from dtdsl.planner.result import Infeasible, PlannerError
from dtdsl.planner.simulated import (
    ESTIMATED,
    SIMULATED,
    SpecData,
    near_plans,
    packing_figures,
    simulate_plan,
)

__all__ = ["EXHAUSTIVE_MAX_GPUS", "OFFLOAD_CHOICES", "PLACEMENTS", "SEARCHES", "Infeasible",
           "PlannerError", "cp_choices", "ep_choices", "plan",
           "plan_baseline", "plan_baselines", "plan_convex", "plan_exhaustive",
           "replan_for_packing", "simulate_plan"]

SEARCHES = ("convex", "exhaustive", "baseline")
OFFLOAD_CHOICES = (0.0, 0.25, 0.5, 1.0)
"""The optimizer offload fractions ``offload=auto`` tries, in order (``plan``)."""
Progress = Callable[[int, int, str], None]


def plan(cost: CostModel, num_gpus: int | None = None, *, search: str = "convex",
         placement: str = "auto", compare_baseline: bool = True,
         progress: Progress | None = None, baseline_progress: Progress | None = None,
         simulate_steps: int = 0, estimate: int = ESTIMATED, simulate: int = SIMULATED
         ) -> Plan:
    """``_plan`` (below) at the spec's optimizer offload, recorded in ``Plan.offload``.
    With ``offload=auto`` the planner chooses: the first fraction of ``OFFLOAD_CHOICES``
    with which a layout fits (offload costs step time, never saves it, so the smallest
    that fits is the one to take), ``Plan.offload_chosen`` set; if none fits, the
    ``Infeasible`` of the whole optimizer on the CPU, which says so."""
    kwargs = {"search": search, "placement": placement, "compare_baseline": compare_baseline,
              "progress": progress, "baseline_progress": baseline_progress,
              "simulate_steps": simulate_steps, "estimate": estimate, "simulate": simulate}
    if cost.program.train.optimizer.offload != "auto":
        result = _plan(cost, num_gpus, **kwargs)
        return result.model_copy(update={"offload": cost.offload_fraction})
    for fraction in OFFLOAD_CHOICES:
        try:
            result = _plan(cost.with_offload(fraction), num_gpus, **kwargs)
        except Infeasible as err:
            if fraction < OFFLOAD_CHOICES[-1]:
                continue
            raise Infeasible(err.message, span=err.span, code=err.code,
                             notes=(*err.notes, "even with the whole optimizer state on the "
                                    "CPU (offload=auto tried " + ", ".join(
                                        f"{f:g}" for f in OFFLOAD_CHOICES) + ")"),
                             hint=err.hint) from None
        return result.model_copy(update={"offload": fraction, "offload_chosen": True})
    raise AssertionError("OFFLOAD_CHOICES is empty")


def _plan(cost: CostModel, num_gpus: int | None = None, *, search: str = "convex",
          placement: str = "auto", compare_baseline: bool = True,
          progress: Progress | None = None, baseline_progress: Progress | None = None,
          simulate_steps: int = 0, estimate: int = ESTIMATED, simulate: int = SIMULATED
          ) -> Plan:
    """Plan with ``search`` and, unless ``compare_baseline`` is off, the Megatron-LM
    baselines on the same cluster (``plan_baselines``: ``Plan.baselines``, each with the
    plan's speedup over it; a baseline no layout of which fits is left out).

    ``placement`` (``planner.placement.PLACEMENTS``): ``disaggregated`` gives every module
    GPUs of its own (the search's layouts), ``colocated`` runs the encoders and generators
    on the backbone's first and last stages (``colocated_layouts``), ``phased`` runs
    encoders on every backbone GPU before and after its pipeline (``UnitPlan.phased``),
    ``auto`` weighs them all and keeps the fastest, each placement's best time in
    ``Plan.placements``.

    ``simulate_steps`` > 0: the objective is the time on that many drawn batches
    (``_placements``): of the layouts near the search's optimum in
    expectation (up to ``estimate``, one per backbone layout) and the co-located ones (one
    per backbone depth), the ``simulate`` best of each placement by the drawn-batch
    estimate (``sim.estimate``) are simulated under the spec's reorder policy and the
    fastest is the plan; then that plan without reordering, and with ``train.packing``
    toggled (``packing_figures``). The Plan's ``simulated`` holds the figures; the
    baselines are chosen on the same batches. ``search = "baseline"``: the plan is the
    ``megatron`` baseline itself. ``progress`` (``baseline_progress`` for the baselines,
    default ``progress``) is called as the work goes, each phase named in its note."""
    if search not in SEARCHES:
        raise ValueError(f"unknown search {search!r}; one of {', '.join(SEARCHES)}")
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}; one of {', '.join(PLACEMENTS)}")
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
    policy = frozenset(cost.program.train.reorder)
    batches = data.batches(cost.program.train.packing) if steps > 0 else None
    found = _placements(cost, num_gpus, search, placement, batches, policy,
                        estimate=estimate, simulate=simulate, progress=progress)
    name = min(found, key=lambda k: (found[k].time, k != "disaggregated"))
    chosen_placement = found[name]
    result = chosen_placement.plan
    if len(found) > 1 or placement == "auto":
        result = result.model_copy(update={"placements": {k: v.time
                                                          for k, v in found.items()}})
    if batches is None:
        return _compared(result, baselines)
    timed, priced = chosen_placement.time, chosen_placement.cost
    plain = timed if not policy else batches.mean_time(priced, result, frozenset())
    packing = packing_figures(priced, result, steps=steps, iteration_time_s=timed,
                              replan=replan_for_packing, data=data, policy=policy)
    result = result.model_copy(update={"simulated": Simulated(
        steps=steps, policy=tuple(sorted(policy)), iteration_time_s=timed,
        no_reorder_iteration_time_s=plain,
        candidates=sum(x.scored for x in found.values()),
        estimated=sum(x.estimated for x in found.values()), packing=packing)})
    return _compared(result, baselines)


@dataclass(frozen=True)
class _Found:
    """A placement's best plan, its time (on the drawn batches, or at mean work) and how
    many layouts were simulated and estimated to find it."""

    plan: Plan
    time: float
    cost: CostModel               # what priced it (the spec's, or with recomputation)
    scored: int = 1
    estimated: int = 0


def replan_for_packing(cost: CostModel, chosen: Plan) -> Plan:
    """The planner's layout for ``cost`` (the spec's data with ``train.packing`` toggled)
    on ``chosen``'s GPUs, search and placement, at mean work (``packing_figures``)."""
    return plan(cost, chosen.num_gpus, search=chosen.search
                if chosen.search != "baseline" else "convex",
                placement=chosen.placement, compare_baseline=False)


def _placements(cost: CostModel, num_gpus: int | None, search: str, placement: str,
                batches, policy: frozenset[str], *, estimate: int, simulate: int,
                progress: Progress | None) -> dict[str, _Found]:
    """Each placement ``placement`` asks for, with its best plan (those with no layout
    that fits left out), each searched with the spec's recomputation and, where the spec
    does not recompute everywhere, with each layer's attention core recomputed and with
    every layer recomputed (``with_recompute``: a layout that fits only so, selective
    where it fits, as it costs less; ``UnitPlan.recompute`` says which the plan runs).
    On drawn batches every candidate (the ``estimate`` fastest at
    mean work per placement) is estimated, the ``simulate`` best simulated, and each
    placement's best by estimate too where none of its own was. Raises ``Infeasible``
    where nothing fits: the disaggregated search's reason, or why nothing co-locates."""
    failure: Infeasible | None = None
    refusal = None
    variants = [("", cost)]
    # Each unit recomputing its attention cores, or its whole layers: the search keeps the
    # fastest layout that fits, so the lighter mode where it fits (it costs less time).
    for mode, label in ((ir.Recompute.SELECTIVE, ", recomputing attention"),
                        (ir.Recompute.FULL, ", recomputing")):
        again = with_recompute(cost, mode=mode)
        if again is not None:
            variants.append((label, again))
    variants += [(label + cp_label, priced.with_cp(cps)) for label, priced in list(variants)
                 for cp_label, cps in cp_choices(cost, num_gpus)]
    variants += [(label + ep_label, priced.with_ep(eps)) for label, priced in list(variants)
                 for ep_label, eps in ep_choices(cost, num_gpus)]
    # cp and ep 1 (the cost model's own) only where the cp(...) and ep(...) constraints
    # allow them.
    program = cost.program
    variants = [(label, priced) for label, priced in variants
                if all(u.ep in program.constraints_for(u.name).ep
                       and u.cp in program.constraints_for(u.name).cp for u in priced.units)]
    candidates: list[tuple[str, Plan, CostModel]] = []
    for label, priced in variants:
        if any(u.cp > 1 for u in priced.units) and placement not in ("auto",
                                                                      "disaggregated"):
            continue
        if placement in ("auto", "disaggregated"):
            planner = plan_convex if search == "convex" else plan_exhaustive
            try:
                searched = planner(priced, num_gpus,
                                   progress=_named(progress, f"{search} search{label}"))
            except Infeasible as err:
                # The recomputing search's reason where both fail: its layouts need less.
                failure = err
            else:
                plans = [searched] if batches is None else near_plans(priced, searched,
                                                                      estimate)
                # Each unit at the lightest recomputation its layout fits with.
                candidates += [("disaggregated", *lightened(cost, p, priced)) for p in plans]
        for name in ("colocated", "phased"):
            # Co-located and phased units run on the backbone's ranks, laid out without CP.
            if placement not in ("auto", name) or any(u.cp > 1 for u in priced.units):
                continue
            refusal = colocation_refusal(priced, name)
            layouts = colocated_layouts(priced, num_gpus, search=search, placement=name) \
                if refusal is None else []
            candidates += [(name, p, priced) for p in layouts[:estimate]]
    if not candidates:
        if placement in ("colocated", "phased"):
            what = {"colocated": "co-located layout: ", "phased": "phased layout: "}
            fits = {"colocated": "no layout with the encoders and generators on the "
                                 "backbone's stages fits",
                    "phased": "no layout with an encoder phased on the backbone's GPUs "
                              "fits"}
            raise Infeasible("no " + what[placement] + (refusal or fits[placement]),
                             cost.program.cluster.span,
                             hint="plan with --placement disaggregated or auto")
        assert failure is not None
        raise failure
    # Per placement the ``estimate`` fastest at mean work, of both variants together.
    kept = []
    for name in dict.fromkeys(n for n, _, _ in candidates):
        mine = [c for c in candidates if c[0] == name]
        kept += sorted(mine, key=lambda c: c[1].iteration_time_s)[:estimate]
    candidates = kept
    if batches is None:
        out: dict[str, _Found] = {}
        for name, p, priced in candidates:
            if name not in out or p.iteration_time_s < out[name].time:
                out[name] = _Found(p, p.iteration_time_s, priced)
        return out
    return _on_drawn_batches(candidates, batches, policy, simulate=simulate,
                             progress=_named(progress, "drawn batches"))


def _axis_choices(cost: CostModel, axis: str, num_gpus: int | None
                  ) -> list[tuple[str, dict[str, int]]]:
    """Every assignment of degrees along ``axis`` ("cp" or "ep") to the units that their
    constraints allow, but 1 everywhere (the cost model's own): a label for progress
    notes and the degrees."""
    program = cost.program
    limit = num_gpus or program.cluster.num_gpus
    names = [u.name for u in cost.units]
    options = [getattr(program.constraints_for(n), axis).candidates(limit) or (1,)
               for n in names]
    if axis == "cp":
        # The runtime splits the backbone's and encoder units' sequences, never a
        # generator's (DT601): one allowed cp 1 keeps it (co-located and phased layouts
        # are searched without CP at all).
        options = [(1,) if u.role == "generator" and 1 in o else o
                   for u, o in zip(cost.units, options, strict=True)]
    out = []
    for combo in itertools.product(*options):
        if all(c == 1 for c in combo):
            continue
        degrees = dict(zip(names, combo, strict=True))
        out.append((f", {axis} " + " ".join(f"{n}={c}" for n, c in degrees.items() if c > 1),
                    degrees))
    return out


def cp_choices(cost: CostModel, num_gpus: int | None = None
               ) -> list[tuple[str, dict[str, int]]]:
    """Every assignment of context parallelism to the units that their ``cp(...)``
    constraints allow, but cp 1 everywhere (``_axis_choices``). Each is searched as a
    cost model of its own (``CostModel.with_cp``), so cp multiplies the searches, not
    their candidates; with no cp constraint (the default: cp 1 only) there is none."""
    return _axis_choices(cost, "cp", num_gpus)


def ep_choices(cost: CostModel, num_gpus: int | None = None
               ) -> list[tuple[str, dict[str, int]]]:
    """Every assignment of expert parallelism to the units that their ``ep(...)``
    constraints allow, but ep 1 everywhere, as ``cp_choices``: each searched as a cost
    model of its own (``CostModel.with_ep``)."""
    return _axis_choices(cost, "ep", num_gpus)


def _on_drawn_batches(candidates: list[tuple[str, Plan, CostModel]], batches,
                      policy: frozenset[str], *, simulate: int,
                      progress: Progress | None) -> dict[str, _Found]:
    """Every placement's fastest of ``candidates`` on ``batches``: all estimated
    (``DrawnBatches.estimate``), the ``simulate`` best simulated, and each placement's
    best by estimate where none of its own was among them."""
    if simulate < 1:
        raise ValueError(f"simulate must be at least 1, not {simulate}")
    estimates = []
    total = len(candidates) + (simulate + 1) * batches.steps
    for k, (name, p, _) in enumerate(candidates):
        if progress is not None:
            progress(k, total, f"estimating a {name} layout")
        estimates.append(batches.estimate(p, policy))
    ranked = sorted(range(len(candidates)), key=lambda k: (estimates[k], k))
    chosen = ranked[:simulate]
    for name in dict.fromkeys(n for n, _, _ in candidates):
        if not any(candidates[k][0] == name for k in chosen):
            chosen.append(next(k for k in ranked if candidates[k][0] == name))
    out: dict[str, _Found] = {}
    for done, k in enumerate(chosen):
        name, p, priced = candidates[k]
        if progress is not None:
            progress(len(candidates) + done * batches.steps, total, f"simulating a {name} "
                     "layout")
        t = batches.mean_time(priced, p, policy)
        if name not in out or t < out[name].time:
            out[name] = _Found(p, t, priced)
    counts = {name: sum(candidates[k][0] == name for k in chosen) for name in out}
    sizes = {name: sum(n == name for n, _, _ in candidates) for name in out}
    return {name: _Found(f.plan, f.time, f.cost, counts[name], sizes[name])
            for name, f in out.items()}


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
