"""DistTrain's disaggregated model orchestration (Algorithm 1), for any number of units.

For every candidate TP/DP of the units (``Space.candidates``) the GPU counts
``g_u = tp_u * dp_u * pp_u`` are chosen by a convex program, then repaired to
integers and evaluated exactly (``Evaluator``). With T_u linear in 1/g_u:

    minimise   W_enc + W_lm + W_gen + (M - 1) * t + s                    (warm-up + steady + sync)
    s.t.       t   >= a_u / g_u                 for every u   a_u = (dp_lm/dp_u) C_u(tp_u) tp_u dp_u
               s   >= s0_u + s1_u / g_u         for every u    (ZeRO-1 gradient sync of a stage)
               W_x >= c_u + h_u g_u             for u in x     (warm-up: (dp_lm/dp_u) C_u / vpp
                                                                plus point-to-point hops 2 (pp - 1);
                                                                DistTrain's T pp / vpp, at most the
                                                                exact T (1 + (pp - 1) / vpp))
               sum_u g_u <= N                                  (the GPU budget)
               lo_u <= g_u <= hi_u                             (memory: the smallest pp that fits;
                                                                at most one stage per layer)

``W_enc`` (``W_gen``) is the slowest encoder (generator): they run side by side.
This relaxes the integer problem (ceil(L/pp)/L >= 1/pp), so its optimum bounds
every integer layout of the candidate from below. Candidates are visited in the
order of a closed-form lower bound (``_integer_fill``: water-filling of the steady
stage time with integer stage sizes and hops, plus the least warm-up and sync,
vectorised over all candidates), and a candidate whose bound cannot beat the best
layout found so far by more than ``tolerance`` is pruned.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import cvxpy as cp
import numpy as np

from dtdsl.cost.model import CostModel
from dtdsl.ir.plan import Plan
from dtdsl.planner.evaluate import Evaluator
from dtdsl.planner.result import Layout, PlannerError, make_plan, no_layout_fits
from dtdsl.planner.space import Candidates, Space, efficient_pps

__all__ = ["Relaxation", "plan_convex", "relaxation_bounds"]

Progress = Callable[[int, int, str], None]

_SOLVER = cp.CLARABEL
_ACCEPTED = (cp.OPTIMAL, cp.OPTIMAL_INACCURATE)


@dataclass(frozen=True)
class Relaxation:
    """The relaxed problem's data for every candidate: arrays of shape (c, n)."""

    candidates: Candidates
    a: np.ndarray            # steady: T_u >= a_u / g_u
    warm: np.ndarray         # warm-up of u without hops (c_u)
    hop: np.ndarray          # warm-up hops per GPU (h_u): 2 (pp - 1) p2p = h_u g_u - 2 p2p
    hop0: np.ndarray         # the constant part of the hops (2 p2p)
    sync0: np.ndarray
    sync1: np.ndarray
    lo: np.ndarray           # GPUs
    hi: np.ndarray
    pp_lo: np.ndarray        # smallest pp that fits in memory (0: none)
    pp_hi: np.ndarray
    steady_mult: np.ndarray  # (c,): M - 1
    feasible: np.ndarray     # (c,)
    bound: np.ndarray        # (c,): closed-form lower bound of the iteration time


def relaxation_bounds(space: Space, cands: Candidates) -> Relaxation:
    """The relaxation's coefficients and a closed-form lower bound for every candidate."""
    ev = space.evaluator
    cost = ev.cost
    n, b = space.n, space.backbone
    tp, dp = cands.tp, cands.dp
    dp_lm = dp[:, b]
    share = dp_lm[:, None] / dp
    stage_gpus = tp * dp
    c_fwd_bwd = np.zeros(tp.shape)
    for i in range(n):
        for t in np.unique(tp[:, i]):
            fwd, bwd = ev.fwd_bwd(i, int(t))
            c_fwd_bwd[tp[:, i] == t, i] = fwd + bwd
    pp_lo = np.zeros(tp.shape, dtype=int)
    pp_hi = np.zeros(tp.shape, dtype=int)
    vmax = np.ones(n)
    sync0 = np.zeros(tp.shape)
    sync1 = np.zeros(tp.shape)
    hop = np.zeros(tp.shape)
    for i, unit in enumerate(space.units):
        # Memory depends on (tp, dp, dp_lm) only: compute it once per distinct triple.
        base = int(max(tp.max(), dp.max())) + 1
        keys, first, inverse = np.unique((tp[:, i] * base + dp[:, i]) * base + dp_lm,
                                         return_index=True, return_inverse=True)
        fit = space.smallest_fitting_pp(i, tp[first, i], dp[first, i], dp_lm[first])
        pp_lo[:, i] = fit[inverse.reshape(-1)]
        allowed = np.asarray(space.pps(i))
        top = allowed.max() if allowed.size else 0
        gpus = space.constraints[i].gpus
        hi = np.full(len(tp), top)
        if gpus.high is not None:
            hi = np.minimum(hi, gpus.high // stage_gpus[:, i])
        pp_hi[:, i] = hi
        pp_lo[:, i] = np.where(pp_lo[:, i] > 0,
                               np.maximum(pp_lo[:, i], -(-gpus.low // stage_gpus[:, i])), 0)
        if allowed.size:
            vmax[i] = np.max(ev.vpp(i, allowed))
        fixed, per_layer = cost.dp_sync_coefficients(unit, tp[:, i], dp[:, i])
        # ceil(L/pp) >= L/pp = L tp dp / g
        sync0[:, i] = fixed
        sync1[:, i] = per_layer * unit.layers * stage_gpus[:, i]
        p2p = cost.p2p_time_s(unit.boundary_bytes * share[:, i])
        hop[:, i] = 2 * p2p / stage_gpus[:, i]
    # No unit can take more than the budget leaves after every other unit's floor.
    floors = stage_gpus * pp_lo
    room = space.num_gpus - (floors.sum(axis=1, keepdims=True) - floors)
    pp_hi = np.minimum(pp_hi, room // stage_gpus)
    a = share * c_fwd_bwd * stage_gpus
    warm = share * c_fwd_bwd / vmax
    hop0 = hop * stage_gpus
    lo = (stage_gpus * pp_lo).astype(float)
    hi = (stage_gpus * pp_hi).astype(float)
    m1 = (space.total_microbatches // dp_lm - 1).astype(float)
    feasible = (pp_lo > 0).all(axis=1) & (pp_lo <= pp_hi).all(axis=1) & \
        (lo.sum(axis=1) <= space.num_gpus)

    t_star = np.full(len(tp), np.inf)
    rows = np.flatnonzero(feasible)
    t_star[rows] = _integer_fill((share * c_fwd_bwd)[rows], hop0[rows],
                                 np.array([u.layers for u in space.units]), stage_gpus[rows],
                                 pp_lo[rows], pp_hi[rows], space.num_gpus)
    roles = [u.role for u in space.units]
    # Warm-up hops and sync at their least: the fewest and the most stages allowed.
    least_hops = hop0 * (pp_lo - 1)
    with np.errstate(invalid="ignore"):   # inf * 0 on infeasible rows, masked next
        bound = _path(warm + least_hops, roles, b) + ev.edge_s + m1 * t_star + \
            (sync0 + sync1 / np.maximum(hi, 1)).max(axis=1)
    bound = np.where(feasible, bound, np.inf)
    return Relaxation(candidates=cands, a=a, warm=warm, hop=hop, hop0=hop0, sync0=sync0,
                      sync1=sync1, lo=lo, hi=hi, pp_lo=pp_lo, pp_hi=pp_hi, steady_mult=m1,
                      feasible=feasible, bound=bound)


def _path(warm: np.ndarray, roles: list[str], backbone: int) -> np.ndarray:
    """Warm-up along the longest path: slowest encoder, the backbone, slowest generator."""
    out = warm[:, backbone].copy()
    for role in ("encoder", "generator"):
        cols = [i for i, r in enumerate(roles) if r == role]
        if cols:
            out += warm[:, cols].max(axis=1)
    return out


def _integer_fill(k: np.ndarray, hop: np.ndarray, layers: np.ndarray, stage_gpus: np.ndarray,
                  pp_lo: np.ndarray, pp_hi: np.ndarray, budget: int) -> np.ndarray:
    """Per row, a lower bound of the slowest stage's time over integer layouts: the
    least t at which giving every unit the fewest stages that reach it fits the budget.
    A unit's stage time is k_u ceil(L_u / pp_u) / L_u, plus ``hop_u`` (activations out,
    gradients back) when pp_u > 1, and pp_u is at least its memory floor. Integer stage
    sizes make this tighter than continuous water-filling (k_u / pp_u <= t), which it
    always dominates; it ignores the allowed-value sets and the sync and warm-up terms,
    so it never exceeds the true optimum."""
    k = np.where(k > 0, k, 1e-30)

    def fits(t):
        t = t[:, None]
        biggest = np.floor((t - hop) * layers / k)              # layers per stage allowed
        pp = np.where(k <= t, 1, np.ceil(layers / np.maximum(biggest, 1)))
        pp = np.maximum(pp, pp_lo)
        ok = ((k <= t) | (biggest >= 1)) & (pp <= pp_hi)
        # A floor above 1 brings the hops in.
        ok &= (pp == 1) | (k * np.ceil(layers / pp) / layers + hop <= t)
        return ok.all(axis=1) & ((stage_gpus * pp).sum(axis=1) <= budget)

    lo_t = np.log((k / layers).max(axis=1) * 0.999)            # below one layer per stage
    hi_t = np.log((k + hop).max(axis=1) * 1.001)               # no more than one stage
    reachable = fits(np.exp(hi_t))
    for _ in range(36):     # to a relative 1e-9 of the range
        mid = (lo_t + hi_t) / 2
        ok = fits(np.exp(mid))
        hi_t = np.where(ok, mid, hi_t)
        lo_t = np.where(ok, lo_t, mid)
    # lo_t is infeasible, so it is below the true minimum: a safe bound.
    return np.where(reachable, np.exp(lo_t), np.inf)


class _ConvexProgram:
    """The relaxation as one parametrised cvxpy problem, compiled once and re-solved
    per candidate with new parameter values (disciplined parametrised programming)."""

    def __init__(self, roles: list[str], backbone: int) -> None:
        n = len(roles)
        # The variable is each unit's share of the budget, g_u / N, so that it and
        # 1 / it stay within a few orders of magnitude for the solver at any scale.
        self.x = cp.Variable(n, name="gpu_share")
        t = cp.Variable(name="stage_time")
        s = cp.Variable(name="sync_time")
        self.a = cp.Parameter(n, nonneg=True, name="a")
        self.warm = cp.Parameter(n, name="warm")          # c_u - 2 p2p_u
        self.hop = cp.Parameter(n, nonneg=True, name="hop")
        self.sync0 = cp.Parameter(n, name="sync0")
        self.sync1 = cp.Parameter(n, nonneg=True, name="sync1")
        self.lo = cp.Parameter(n, nonneg=True, name="lo")
        self.hi = cp.Parameter(n, nonneg=True, name="hi")
        self.m1 = cp.Parameter(nonneg=True, name="steady_microbatches")
        warm_u = self.warm + cp.multiply(self.hop, self.x)
        constraints = [
            # Steady state: every unit's stage finishes a microbatch within t.
            cp.multiply(self.a, cp.inv_pos(self.x)) <= t,
            # Gradient synchronisation, the slowest unit's.
            self.sync0 + cp.multiply(self.sync1, cp.inv_pos(self.x)) <= s,
            # The GPU budget, and each unit between its memory floor and one stage per layer.
            cp.sum(self.x) <= 1,
            self.x >= self.lo,
            self.x <= self.hi,
        ]
        objective = warm_u[backbone] + self.m1 * t + s
        for role in ("encoder", "generator"):
            cols = [i for i, r in enumerate(roles) if r == role]
            if cols:
                w = cp.Variable(name=f"warmup_{role}")
                constraints.append(warm_u[cols] <= w)
                objective = objective + w
        self.problem = cp.Problem(cp.Minimize(objective), constraints)
        assert self.problem.is_dpp()

    def solve(self, rel: Relaxation, c: int, budget: int) -> tuple[np.ndarray, float]:
        """The relaxed optimum of candidate ``c``: GPU counts and objective (without the
        constant edge transfers). Raises PlannerError when the solver does not converge."""
        # In units of the budget: g = N x, so a / g = (a / N) / x and h g = (h N) x.
        self.a.value = rel.a[c] / budget
        self.warm.value = rel.warm[c] - rel.hop0[c]
        self.hop.value = rel.hop[c] * budget
        self.sync0.value = rel.sync0[c]
        self.sync1.value = rel.sync1[c] / budget
        self.lo.value = rel.lo[c] / budget
        self.hi.value = rel.hi[c] / budget
        self.m1.value = float(rel.steady_mult[c])
        try:
            with warnings.catch_warnings():
                # OPTIMAL_INACCURATE is accepted and re-checked below; its warning is noise.
                warnings.simplefilter("ignore", UserWarning)
                self.problem.solve(solver=_SOLVER)
        except cp.error.SolverError as exc:
            raise PlannerError(f"the convex solver failed on a candidate: {exc}") from exc
        if self.problem.status not in _ACCEPTED:
            raise PlannerError(f"the convex solver returned '{self.problem.status}' for a "
                               "candidate whose memory floors fit the budget")
        g = np.asarray(self.x.value, dtype=float) * budget
        return g, float(self.problem.value)


def _recheck(rel: Relaxation, c: int, g: np.ndarray, value: float, budget: int,
             roles: list[str], backbone: int) -> None:
    """Re-verify the solver's answer in plain numpy: feasible, and its objective."""
    slack = 1e-5 * max(budget, 1)
    if g.sum() > budget + slack or (g < rel.lo[c] - slack).any() or \
            (g > rel.hi[c] + slack).any():
        raise PlannerError("the convex solver's answer violates its constraints")
    warm = rel.warm[c] - rel.hop0[c] + rel.hop[c] * g
    objective = _path(warm[None, :], roles, backbone)[0] + \
        rel.steady_mult[c] * (rel.a[c] / g).max() + (rel.sync0[c] + rel.sync1[c] / g).max()
    if not math.isclose(objective, value, rel_tol=1e-3, abs_tol=1e-6):
        raise PlannerError(f"the convex solver reports {value:.6g} s but its answer costs "
                           f"{objective:.6g} s")


def _window(allowed: tuple[int, ...], target: float, lo: int, hi: int,
            width: int = 2) -> list[int]:
    """Up to ``width`` allowed values on each side of ``target`` within [lo, hi]."""
    inside = [p for p in allowed if lo <= p <= hi]
    below = [p for p in inside if p <= target][-width:]
    above = [p for p in inside if p > target][:width]
    return sorted(set(below + above + inside[:1]))


def repair(space: Space, tps: tuple[int, ...], dps: tuple[int, ...], pp_lo, pp_hi,
           target_pp: np.ndarray) -> tuple[Layout | None, int]:
    """The best integer layout near the relaxed optimum: for every unit the efficient
    pipeline depths around its relaxed one, all combinations evaluated exactly. When
    none of them is feasible (the memory floors assumed the fewest stages downstream),
    every efficient combination is tried. Returns the layout and how many were evaluated."""
    choices = [efficient_pps(space.units[i].layers, space.pps(i)) for i in range(space.n)]
    windows = [_window(choices[i], target_pp[i], int(pp_lo[i]), int(pp_hi[i]))
               for i in range(space.n)]
    best, evaluated = _best_of(space, tps, dps, windows)
    if best is None:
        full = [[p for p in choices[i] if pp_lo[i] <= p <= pp_hi[i]] for i in range(space.n)]
        if 0 < math.prod(len(f) for f in full) <= 1_000_000:
            best, more = _best_of(space, tps, dps, full)
            evaluated += more
    return best, evaluated


def _best_of(space: Space, tps, dps, pp_lists) -> tuple[Layout | None, int]:
    if any(not p for p in pp_lists):
        return None, 0
    grids = np.meshgrid(*[np.asarray(p) for p in pp_lists], indexing="ij", sparse=True)
    est = space.evaluator.evaluate(tps, dps, grids)
    ok = np.asarray(est.feasible)
    for i in range(space.n):
        ok = ok & space.gpus_allowed(i, tps[i] * dps[i] * grids[i])
    size = int(ok.size)
    if not ok.any():
        return None, size
    times = np.where(ok, est.iteration_time_s, np.inf)
    k = np.unravel_index(np.argmin(times), times.shape)
    pps = tuple(int(p[j]) for p, j in zip(pp_lists, k, strict=True))
    return Layout(tp=tuple(tps), dp=tuple(dps), pp=pps, iteration_time_s=float(times[k])), size


def plan_convex(cost: CostModel, num_gpus: int | None = None, *, tolerance: float = 1e-3,
                progress: Progress | None = None) -> Plan:
    """Algorithm 1: the layout with the least predicted iteration time, found by
    branch and bound over the candidates with one convex program per candidate
    that survives the bound. Raises ``Infeasible`` when no layout fits, naming the
    binding constraint, and ``PlannerError`` when the solver misbehaves."""
    start = time.perf_counter()
    num_gpus = num_gpus or cost.program.cluster.num_gpus
    ev = Evaluator(cost, num_gpus)
    space = Space(ev)
    cands = space.candidates()
    if not len(cands):
        raise no_layout_fits(space)
    rel = relaxation_bounds(space, cands)
    roles = [u.role for u in space.units]
    order = np.argsort(rel.bound, kind="stable")
    order = order[np.isfinite(rel.bound[order])]
    if not len(order):
        raise no_layout_fits(space)
    program = _ConvexProgram(roles, space.backbone)
    best: Layout | None = None
    solves = evaluated = 0
    for visited, c in enumerate(order):
        if best is not None and rel.bound[c] >= best.iteration_time_s * (1 - tolerance):
            break
        if progress is not None:
            progress(visited, len(order), f"{solves} convex solves")
        g, value = program.solve(rel, c, num_gpus)
        solves += 1
        _recheck(rel, c, g, value, num_gpus, roles, space.backbone)
        if best is not None and value + ev.edge_s >= best.iteration_time_s * (1 - tolerance):
            continue
        tps, dps = tuple(int(x) for x in cands.tp[c]), tuple(int(x) for x in cands.dp[c])
        layout, n_eval = repair(space, tps, dps, rel.pp_lo[c], rel.pp_hi[c],
                                g / (cands.tp[c] * cands.dp[c]))
        evaluated += n_eval
        if layout is not None and (best is None or
                                   layout.iteration_time_s < best.iteration_time_s):
            best = layout
    if progress is not None:
        progress(len(order), len(order), f"{solves} convex solves")
    if best is None:
        raise no_layout_fits(space)
    return make_plan(ev, "convex", best, solve_time_s=time.perf_counter() - start,
                     candidates=len(cands), convex_solves=solves, evaluated=evaluated)
