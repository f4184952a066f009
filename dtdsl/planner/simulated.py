"""Plans scored on drawn batches: the planner's stragglers term.

The pipeline formula (``planner.evaluate``) prices mean work. Real batches are not mean:
an encoder replica with a step's largest images holds up the backbone's replicas it
feeds, and the reorder policy (``train.reorder``) removes part of that. ``simulate_plan``
runs the lowered schedule of a plan on ``steps`` global batches drawn from the spec's data
(the same batches for every plan: step k's draw is seeded by the spec's seed and k),
routed under a policy, and returns the mean iteration time; ``plan`` in this package
scores its best candidate layouts with it under the spec's policy and keeps the fastest,
and reports the chosen plan without reordering and the baseline on the same batches.

``packing_figures`` runs the chosen layout again with ``train.packing`` toggled (the
spec's program copied with the other setting, its own cost model, the plan's unit times
scaled to it by ``repriced``) on the same steps, so ``dtc plan`` can say whether packing
would train faster.
"""

from __future__ import annotations

from statistics import fmean

from dtdsl.cost.model import CostModel, build_cost_model
from dtdsl.ir.plan import Packing, Plan

__all__ = ["packing_figures", "repriced", "simulate_plan"]


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


def repriced(plan: Plan, cost: CostModel, other: CostModel) -> Plan:
    """``plan`` (priced by ``cost``) with every unit's forward and backward times priced by
    ``other``, a cost model of the same modules under other training settings: each
    scaled by the ratio of the unit's times under the two at its TP degree (a plan's
    times are linear in them, whatever its stages and shares). Layout, memory and the
    gradient sync (a function of the parameters) stay."""
    units = []
    for u in plan.units:
        tp = 1 if u.tp_replicated else u.tp
        old = cost.fwd_bwd_time_s(cost.unit(u.name), tp)
        new = other.fwd_bwd_time_s(other.unit(u.name), tp)
        units.append(u.model_copy(update={
            "fwd_time_s": u.fwd_time_s * new[0] / old[0] if old[0] > 0 else u.fwd_time_s,
            "bwd_time_s": u.bwd_time_s * new[1] / old[1] if old[1] > 0 else u.bwd_time_s}))
    return plan.model_copy(update={"units": tuple(units)})


def _positions_per_step(cost: CostModel, steps: int) -> float:
    """The mean positions (text and encoder tokens) of the first ``steps`` drawn batches."""
    from dtdsl.cost.samples import positions
    from dtdsl.sim.workload import batch_samples

    return fmean(float(positions(batch_samples(cost.program, k)).sum()) for k in range(steps))


def packing_figures(cost: CostModel, plan: Plan, *, steps: int,
                    iteration_time_s: float) -> Packing | None:
    """``plan`` on the first ``steps`` drawn batches without reordering, with
    ``train.packing`` as the spec sets it (``iteration_time_s``, already simulated) and
    toggled. Without reordering on both sides: it is the same comparison, and intra's
    search on a packed batch's near-equal rows would cost ``dtc plan`` seconds. None with
    a measured profile: it times the backbone on whole sequences, not packed documents."""
    if cost.profile is not None:
        return None
    program = cost.program
    toggled = program.model_copy(update={"train": program.train.model_copy(
        update={"packing": not program.train.packing})})
    other = build_cost_model(toggled, cost.params)
    other_s = simulate_plan(other, repriced(plan, cost, other), policy=frozenset(),
                            steps=steps)
    ours, theirs = _positions_per_step(cost, steps), _positions_per_step(other, steps)
    if program.train.packing:
        return Packing(spec_packs=True, packed_s=iteration_time_s, unpacked_s=other_s,
                       packed_positions=ours, unpacked_positions=theirs)
    return Packing(spec_packs=False, packed_s=other_s, unpacked_s=iteration_time_s,
                   packed_positions=theirs, unpacked_positions=ours)
