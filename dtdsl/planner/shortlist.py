"""The layouts worth scoring on drawn batches: those near the optimum in expectation, one per
backbone layout.

A search (convex or exhaustive) finds the layout of least mean-work time. On real batches
another layout near it may be faster: a shallower backbone pipeline suffers less from
microbatches of different work, a generator with more replicas is never the slowest unit
on a heavy step (``sim.estimate``). ``near_layouts`` lists, for every TP/DP candidate and
backbone depth, the fastest layout at mean work within ``within`` of the optimum, and
keeps the fastest of each backbone layout (TP, DP, PP): layouts that differ only in the
other units are the same pipeline to the drawn batches, nearly. Its answer depends on the
cost model and the budget alone, not on the search that found the optimum: the convex
and the exhaustive searches hand the same list to the drawn-batch objective.

Candidates are visited in the order of the relaxation's lower bound
(``orchestrate.relaxation_bounds``) and every layout of a visited candidate is evaluated
(``Evaluator``, one grid per candidate); the visit stops at the first candidate whose
bound cannot beat the ``count``-th fastest backbone layout found (nor the cut at
``within`` of the optimum), so the list is exact.
"""

from __future__ import annotations

import numpy as np

from dtdsl.cost.model import CostModel
from dtdsl.planner.evaluate import Evaluator
from dtdsl.planner.orchestrate import relaxation_bounds
from dtdsl.planner.result import Layout
from dtdsl.planner.space import Space

__all__ = ["near_layouts"]

# Candidates evaluated between two checks of the stopping rule.
_CHUNK = 32


def near_layouts(cost: CostModel, num_gpus: int, *, ceiling: float, within: float = 0.25,
                 count: int = 8) -> list[Layout]:
    """Up to ``count`` layouts, fastest at mean work first: per backbone layout (TP, DP,
    PP), the fastest layout within ``within`` of the optimum. ``ceiling``: an iteration
    time no less than the optimum (a search's answer), which bounds the candidates
    visited; the list does not depend on it otherwise."""
    if count < 1:
        return []
    ev = Evaluator(cost, num_gpus)
    space = Space(ev)
    cands = space.candidates()
    if not len(cands):
        return []
    rel = relaxation_bounds(space, cands, coarse=True)
    limit = ceiling * (1 + within)
    near = np.flatnonzero(rel.bound < limit)               # coarse bounds are lower bounds
    rel.refine(near)
    near = near[rel.bound[near] < limit]
    near = near[np.argsort(rel.bound[near], kind="stable")]
    depths = [np.asarray(space.depths(i)) for i in range(space.n)]
    best: dict[tuple[int, int, int], Layout] = {}
    for at in range(0, len(near), _CHUNK):
        if rel.bound[near[at]] >= _threshold(best, within, count, limit):
            break
        for c in near[at:at + _CHUNK]:
            for layout in _per_backbone_depth(space, rel, c, depths):
                b = space.backbone
                key = (layout.tp[b], layout.dp[b], layout.pp[b])
                if key not in best or _faster(layout, best[key]):
                    best[key] = layout
    if not best:
        return []
    cut = min(x.iteration_time_s for x in best.values()) * (1 + within)
    kept = sorted((x for x in best.values() if x.iteration_time_s <= cut), key=_rank)
    return kept[:count]


def _rank(layout: Layout) -> tuple:
    """Fastest first; equal times in a fixed order (the layout's own numbers)."""
    return (layout.iteration_time_s, layout.tp, layout.dp, layout.pp)


def _faster(a: Layout, b: Layout) -> bool:
    return _rank(a) < _rank(b)


def _threshold(best: dict, within: float, count: int, limit: float) -> float:
    """No candidate whose bound is at or above this can enter the list."""
    if not best:
        return limit
    times = sorted(x.iteration_time_s for x in best.values())
    out = min(limit, times[0] * (1 + within))
    if len(times) >= count:
        out = min(out, times[count - 1])
    return out


def _per_backbone_depth(space: Space, rel, c: int, depths: list[np.ndarray]) -> list[Layout]:
    """Candidate ``c``'s fastest feasible layout at each backbone depth."""
    ev = space.evaluator
    tps = tuple(int(x) for x in rel.candidates.tp[c])
    dps = tuple(int(x) for x in rel.candidates.dp[c])
    lists = [d[(d >= rel.pp_lo[c, i]) & (d <= rel.pp_hi[c, i])] for i, d in enumerate(depths)]
    if any(not len(x) for x in lists):
        return []
    grids = np.meshgrid(*lists, indexing="ij", sparse=True)
    est = ev.evaluate(tps, dps, grids)
    ok = np.broadcast_to(np.asarray(est.feasible), tuple(len(x) for x in lists))
    for i in range(space.n):
        ok = ok & space.gpus_allowed(i, tps[i] * dps[i] * space.cps[i] * grids[i])
    times = np.where(ok, np.broadcast_to(est.iteration_time_s, ok.shape), np.inf)
    b = space.backbone
    by_depth = np.moveaxis(times, b, 0).reshape(len(lists[b]), -1)
    out = []
    for k, pb in enumerate(lists[b]):
        j = int(np.argmin(by_depth[k]))
        t = float(by_depth[k, j])
        if not np.isfinite(t):
            continue
        rest = np.unravel_index(j, tuple(len(x) for i, x in enumerate(lists) if i != b))
        others = iter(rest)
        pps = tuple(int(pb) if i == b else int(lists[i][next(others)]) for i in range(space.n))
        out.append(Layout(tp=tps, dp=dps, pp=pps, iteration_time_s=t))
    return out
