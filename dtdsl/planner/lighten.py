"""Recomputation chosen per unit: the planner searches each layout with the spec's
recomputation and with every unit raised alike (selective, then full;
``planner._placements``); ``lightened`` then lowers each unit of a plan found so to the
lightest mode at which the same layout still fits in memory. Recomputing only costs
time, so the layout with less of it is no slower, and a unit that fits without
recomputing does not pay for the neighbour that needed it (``UnitPlan.recompute``, which
the runtime reads per unit)."""

from __future__ import annotations

from dtdsl.cost.model import CostModel
from dtdsl.ir import program as ir
from dtdsl.ir.plan import Plan
from dtdsl.planner.baseline import with_recompute
from dtdsl.planner.evaluate import Evaluator
from dtdsl.planner.placement import plan_fits
from dtdsl.planner.result import Layout, make_plan

__all__ = ["lightened"]

_ORDER = (ir.Recompute.NONE, ir.Recompute.SELECTIVE, ir.Recompute.FULL)


def _priced(base: CostModel, plan: Plan, modes: dict[str, ir.Recompute]) -> CostModel:
    """``base`` with ``modes`` (per unit, at least the spec's) and ``plan``'s context
    and expert parallelism: the model that prices ``plan`` so."""
    model = with_recompute(base, modes=modes) or base
    if any(u.cp != 1 for u in plan.units):
        model = model.with_cp({u.name: u.cp for u in plan.units})
    if any(u.ep != 1 for u in plan.units):
        model = model.with_ep({u.name: u.ep for u in plan.units})
    return model


def lightened(base: CostModel, plan: Plan, priced: CostModel) -> tuple[Plan, CostModel]:
    """``plan`` (disaggregated, priced by ``priced``: a variant of ``base``) with each
    unit that recomputes more than the spec asks lowered, unit by unit in plan order, to
    the lightest mode at which its layout still fits; with the model that prices it.
    ``plan`` and ``priced`` themselves where no unit can be lowered."""
    spec = {m.name: ir.Recompute.of(m.recompute) for m in base.program.modules}
    modes = {u.name: ir.Recompute.of(u.recompute) for u in plan.units}
    model = priced
    for name in list(modes):
        for lighter in _ORDER[spec[name].rank:modes[name].rank]:
            trial = {**modes, name: lighter}
            candidate = _priced(base, plan, trial)
            if plan_fits(candidate, plan):
                modes, model = trial, candidate
                break
    if model is priced:
        return plan, priced
    ev = Evaluator(model, plan.num_gpus)
    units = {u.name: u for u in plan.units}
    order = [units[u.name] for u in ev.units]
    tps, dps = tuple(u.tp for u in order), tuple(u.dp for u in order)
    pps, replicated = tuple(u.pp for u in order), tuple(u.tp_replicated for u in order)
    est = ev.evaluate(tps, dps, pps, replicated=replicated)
    layout = Layout(tp=tps, dp=dps, pp=pps, iteration_time_s=float(est.iteration_time_s),
                    replicated=replicated)
    again = make_plan(ev, plan.search, layout, solve_time_s=plan.solve_time_s,
                      candidates=plan.candidates, convex_solves=plan.convex_solves,
                      evaluated=plan.evaluated)
    return again, model
