"""The exhaustive planner: every integer layout of every candidate, evaluated exactly.

The reference that shows the convex planner finds the optimum: no relaxation, no
bounds, no pruning of candidates. It tries every TP/DP candidate and, for each,
every combination of the units' pipeline depths that fits the budget, so its cost
grows with the product of the units' depths; it refuses clusters above
``MAX_GPUS``.

By default a depth that is *dominated* is left out: a pp whose stage size
ceil(L/pp) a smaller pp already gives (``efficient_pps``). Such a pp has the same
stage time and sync, more GPUs, a longer warm-up, more hops and more microbatches
in flight, and cannot enable interleaving (pp * v | L makes pp a divisor of L,
and a divisor is always the smallest pp of its stage size), so leaving it out
never loses the optimum. The exception is a unit with a `gpus` constraint, whose
allowed counts may need such a depth: it keeps every depth. ``dominated=True``
tries every depth of every unit (tests check the two agree).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from dtdsl.cost.model import CostModel
from dtdsl.ir.plan import Plan
from dtdsl.planner.evaluate import Evaluator
from dtdsl.planner.result import Layout, make_plan, no_layout_fits
from dtdsl.planner.space import Space

__all__ = ["MAX_GPUS", "plan_exhaustive"]

MAX_GPUS = 128

Progress = Callable[[int, int, str], None]


def plan_exhaustive(cost: CostModel, num_gpus: int | None = None, *, dominated: bool = False,
                    progress: Progress | None = None) -> Plan:
    """The best layout over every allowed TP, DP and PP of every unit (``dominated``:
    also the depths no optimum needs; see the module docstring)."""
    start = time.perf_counter()
    num_gpus = num_gpus or cost.program.cluster.num_gpus
    if num_gpus > MAX_GPUS:
        raise ValueError(f"the exhaustive search is limited to {MAX_GPUS} GPUs "
                         f"(asked for {num_gpus}); use the convex search")
    ev = Evaluator(cost, num_gpus)
    space = Space(ev)
    cands = space.candidates()
    depths = [space.depths(i, dominated=dominated) for i in range(space.n)]
    best: Layout | None = None
    evaluated = 0
    for c in range(len(cands)):
        if progress is not None and c % 64 == 0:
            progress(c, len(cands), f"{evaluated} layouts")
        tps = tuple(int(x) for x in cands.tp[c])
        dps = tuple(int(x) for x in cands.dp[c])
        stage = [t * d * c for t, d, c in zip(tps, dps, space.cps, strict=True)]
        spare = num_gpus - sum(stage)       # beyond one stage per unit
        pps = [np.asarray([p for p in depths[i] if (p - 1) * stage[i] <= spare])
               for i in range(space.n)]
        if any(p.size == 0 for p in pps):
            continue
        grids = np.meshgrid(*pps, indexing="ij", sparse=True)
        est = ev.evaluate(tps, dps, grids)
        ok = np.asarray(est.feasible)
        for i in range(space.n):
            ok = ok & space.gpus_allowed(i, stage[i] * grids[i])
        evaluated += ok.size
        if not ok.any():
            continue
        times = np.where(ok, est.iteration_time_s, np.inf)
        k = np.unravel_index(np.argmin(times), times.shape)
        if best is None or times[k] < best.iteration_time_s:
            best = Layout(tp=tps, dp=dps, pp=tuple(int(p[j]) for p, j in zip(pps, k, strict=True)),
                          iteration_time_s=float(times[k]))
    if progress is not None:
        progress(len(cands), len(cands), f"{evaluated} layouts")
    if best is None:
        raise no_layout_fits(space)
    return make_plan(ev, "exhaustive", best, solve_time_s=time.perf_counter() - start,
                     candidates=len(cands), convex_solves=0, evaluated=evaluated)
