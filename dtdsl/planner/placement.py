"""Where the encoders and generators run: the placements the planner weighs.

- ``disaggregated``: every module on GPUs of its own, each with its own TP, DP and depth
  (DistTrain's orchestration: the convex and exhaustive searches);
- ``colocated``: the encoders on the GPUs of the backbone's first pipeline stage, the
  generators on those of its last, split by the backbone's TP over its DP replicas, and
  the backbone's layers split unevenly so that those stages stay balanced: the layout
  Megatron-LM users build by hand (``--encoder-pipeline-model-parallel-size 0`` with
  ``--decoder-first-pipeline-num-layers``), run as dtdsl runs it: microbatches padded to
  their longest sequence, the spec's recomputation and reorder policy.

``colocated_layouts`` lists, per backbone depth, the fastest co-located layout at mean
work (``baseline.Colocation`` prices the uneven 1F1B and checks each stage's memory with
the modules it hosts); ``planner.plan`` scores them on the drawn batches beside the
disaggregated ones and, under ``auto``, keeps the faster placement
(``Plan.placements`` records each placement's best time, so the choice is explained).
"""

from __future__ import annotations

import math
import time

import numpy as np

from dtdsl.cost.model import CostModel
from dtdsl.ir.plan import Plan
from dtdsl.planner.baseline import Colocation, colocated_plan
from dtdsl.planner.evaluate import Evaluator
from dtdsl.planner.space import Space, efficient_pps

__all__ = ["PLACEMENTS", "colocated_layouts", "colocation_refusal", "plan_fits"]

PLACEMENTS = ("auto", "disaggregated", "colocated")


def colocation_refusal(cost: CostModel) -> str | None:
    """Why no co-located layout of ``cost``'s program can exist (None when one may): no
    encoder or generator to co-locate, or a constraint that gives one GPUs of its own or
    more than one stage."""
    space = Space(Evaluator(cost, cost.program.cluster.num_gpus))
    others = [i for i in range(space.n) if i != space.backbone]
    if not others:
        return "the spec has no encoder or generator to co-locate"
    for i in others:
        name = space.units[i].name
        if 1 not in space.pps(i):
            return f"{name} is constrained to more than one pipeline stage"
        gpus = space.constraints[i].gpus
        if gpus.values is not None or gpus.high is not None or gpus.low > 1:
            return f"{name} is constrained to GPUs of its own (a gpus constraint)"
    return None


def colocated_layouts(cost: CostModel, num_gpus: int | None = None, *,
                      search: str = "convex") -> list[Plan]:
    """Per backbone depth, the fastest co-located layout of ``cost``'s program at mean
    work that fits: every backbone TP (a co-located module is split by the backbone's TP
    groups, or replicated over them where it cannot be: ``Colocation.replicated``), every
    backbone DP that each of them allows, the depths that are not dominated
    (``efficient_pps``). Fastest first; empty where none
    fits or ``colocation_refusal`` names a reason. ``search``: the Plans' search field."""
    start = time.perf_counter()
    num_gpus = num_gpus or cost.program.cluster.num_gpus
    if colocation_refusal(cost) is not None:
        return []
    ev = Evaluator(cost, num_gpus)
    space = Space(ev)
    b = space.backbone
    others = [i for i in range(space.n) if i != b]
    pps = np.asarray(efficient_pps(ev.units[b].layers, space.pps(b)), dtype=int)
    dp_lms = space.dp_lms()
    co = Colocation(ev, tuple(space.total_microbatches // dp for dp in dp_lms))
    best: dict[int, tuple[float, int, int]] = {}
    candidates = evaluated = 0
    for tp in space.tps(b):
        for dp in dp_lms:
            if tp * dp > num_gpus or any(dp not in space.dps(i, dp) for i in others):
                continue
            candidates += 1
            allowed = space.gpus_allowed(b, tp * dp * pps)
            bars = [best[p][0] if p in best else math.inf for p in pps.tolist()]
            figures = co.evaluate(tp, dp, pps, bars)
            evaluated += int(pps.size)
            for k, p in enumerate(pps.tolist()):
                if not (allowed[k] and figures.gpus_ok[k]) or figures.time[k] >= bars[k]:
                    continue
                if co.memory(tp, dp, p, figures.splits[k])[0]:
                    best[p] = (float(figures.time[k]), tp, dp)
    solve = time.perf_counter() - start
    plans = [colocated_plan(co, tp, dp, p, search=search, padding="longest",
                            solve_time_s=solve, candidates=candidates, evaluated=evaluated,
                            time=t)
             for p, (t, tp, dp) in best.items()]
    return sorted(plans, key=lambda x: (x.iteration_time_s, x.units[b].pp))


def plan_fits(cost: CostModel, plan: Plan) -> bool:
    """Whether ``plan``'s layout fits in memory priced by ``cost`` (a cost model of its
    modules, under the plan's training settings or others): its own units' first stages,
    and for a co-located plan every backbone stage with the modules it hosts."""
    ev = Evaluator(cost, plan.num_gpus)
    units = {u.name: u for u in plan.units}
    backbone = next(u for u in plan.units if u.role == "backbone")
    if any(u.colocated for u in plan.units):
        if not all(u.colocated for u in plan.units if u.role != "backbone"):
            raise ValueError("a plan co-locates all of its encoders and generators or none")
        co = Colocation(ev, (plan.num_microbatches,))
        return co.memory(backbone.tp, backbone.dp, backbone.pp,
                         backbone.layers_per_stage)[0]
    order = [units[u.name] for u in ev.units]
    est = ev.evaluate(tuple(u.tp for u in order), tuple(u.dp for u in order),
                      tuple(u.pp for u in order),
                      replicated=tuple(u.tp_replicated for u in order))
    return bool(est.feasible)
