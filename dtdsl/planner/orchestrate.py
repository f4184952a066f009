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
                                                                exact T (1 + (pp - 1) / vpp); under
                                                                zero_bubble C_u less twice its W)
               sum_u g_u <= N                                  (the GPU budget)
               lo_u <= g_u <= hi_u                             (memory: the smallest pp that fits;
                                                                at most one stage per layer)

``W_enc`` (``W_gen``) is the slowest encoder (generator): they run side by side.
This relaxes the integer problem (ceil(L/pp)/L >= 1/pp), so its optimum bounds
every integer layout of the candidate from below. Candidates are visited in the
order of a closed-form lower bound (``_Fill``: water-filling of the steady stage time
with integer stage sizes and hops, plus the least warm-up and sync, vectorised over all
candidates), and the search stops at the first whose bound cannot beat the best layout
found so far by more than ``tolerance``. Before its convex program, a visited candidate
is bounded once more with its integer depths (``_IntegerBound``: steady time, warm-up
and sync coupled through the stages each unit needs), and skipped when that bound shows
it cannot beat the best layout: the answer is the same, with far fewer convex programs
(issue 18: audio_image, five units, on 99 GPUs, from 145 to 3).
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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
# Clarabel's tolerances for a second try when its answer's objective is not the one it
# reports: a unit with a tiny share of a large budget (a generator's one GPU of 1296)
# can leave its steady-state constraint violated by 0.5-7% at the defaults (mllm_72b on
# 1296 GPUs). Tighter tolerances mend some; the others are repaired without pruning.
_PRECISE = {"tol_gap_abs": 1e-10, "tol_gap_rel": 1e-10, "tol_feas": 1e-10}


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
    head: np.ndarray         # (c,): its least warm-up plus the edge transfers
    sync_least: np.ndarray   # (c,): its least sync
    fill: _Fill              # the steady stage time's bisection, over the feasible rows
    fill_row: np.ndarray     # (c,): a candidate's row in ``fill`` (-1: infeasible)

    def update(self, cands: np.ndarray) -> None:
        """Recompute ``bound`` of these (feasible) candidates from the fill's state."""
        t_star = self.fill.lower(self.fill_row[cands])
        with np.errstate(invalid="ignore"):   # inf * 0 when the fill is unreachable
            self.bound[cands] = self.head[cands] + self.steady_mult[cands] * t_star + \
                self.sync_least[cands]

    def refine(self, cands: np.ndarray) -> None:
        """Finish the fill's bisection for these candidates: their ``bound`` is then
        exactly what ``relaxation_bounds`` gives without ``coarse``."""
        cands = np.asarray(cands)
        cands = cands[self.feasible[cands]]
        rows = self.fill_row[cands]
        todo = self.fill.steps[rows] < _FILL_STEPS
        cands, rows = cands[todo], rows[todo]
        if len(rows):
            self.fill.bisect(rows, _FILL_STEPS - int(self.fill.steps[rows].max()))
            self.update(cands)


def relaxation_bounds(space: Space, cands: Candidates, *, coarse: bool = False) -> Relaxation:
    """The relaxation's coefficients and a closed-form lower bound for every candidate
    (``coarse``: a looser one, exact after ``Relaxation.refine``)."""
    ev = space.evaluator
    cost = ev.cost
    n, b = space.n, space.backbone
    tp, dp = cands.tp, cands.dp
    dp_lm = dp[:, b]
    share = dp_lm[:, None] / dp
    stage_gpus = tp * dp * space.cps           # one stage of each unit: tp x cp x dp
    c_fwd_bwd = np.zeros(tp.shape)
    c_hidden = np.zeros(tp.shape)      # zero_bubble: twice the W its bubbles hide
    for i in range(n):
        for t in np.unique(tp[:, i]):
            fwd, bwd = ev.fwd_bwd(i, int(t))
            c_fwd_bwd[tp[:, i] == t, i] = fwd + bwd
            c_hidden[tp[:, i] == t, i] = 2 * ev.weight_s(i, bwd)
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
        p2p = cost.hop_time_s(unit, tp[:, i], share[:, i])
        hop[:, i] = 2 * p2p / stage_gpus[:, i]
    # No unit can take more than the budget leaves after every other unit's floor.
    floors = stage_gpus * pp_lo
    room = space.num_gpus - (floors.sum(axis=1, keepdims=True) - floors)
    pp_hi = np.minimum(pp_hi, room // stage_gpus)
    a = share * c_fwd_bwd * stage_gpus
    # ZB-H1's T + (T - 2 W) (pp - 1) is at least pp (T - 2 W) >= C - 2 W of the whole unit.
    warm = share * (c_fwd_bwd - c_hidden) / vmax
    hop0 = hop * stage_gpus
    lo = (stage_gpus * pp_lo).astype(float)
    hi = (stage_gpus * pp_hi).astype(float)
    m1 = (space.total_microbatches // dp_lm - 1).astype(float)
    feasible = (pp_lo > 0).all(axis=1) & (pp_lo <= pp_hi).all(axis=1) & \
        (lo.sum(axis=1) <= space.num_gpus)

    rows = np.flatnonzero(feasible)
    fill = _Fill((share * c_fwd_bwd)[rows], hop0[rows],
                 np.array([u.layers for u in space.units]), stage_gpus[rows],
                 pp_lo[rows], pp_hi[rows], space.num_gpus)
    fill.bisect(slice(None), _COARSE_STEPS if coarse else _FILL_STEPS)
    roles = [u.role for u in space.units]
    # Warm-up hops and sync at their least: the fewest and the most stages allowed.
    least_hops = hop0 * (pp_lo - 1)
    head = _path(warm + least_hops, roles, b) + ev.edge_s
    sync_least = (sync0 + sync1 / np.maximum(hi, 1)).max(axis=1)
    row_of = np.full(len(tp), -1)
    row_of[rows] = np.arange(len(rows))
    rel = Relaxation(candidates=cands, a=a, warm=warm, hop=hop, hop0=hop0, sync0=sync0,
                     sync1=sync1, lo=lo, hi=hi, pp_lo=pp_lo, pp_hi=pp_hi, steady_mult=m1,
                     feasible=feasible, bound=np.full(len(tp), np.inf), head=head,
                     sync_least=sync_least, fill=fill, fill_row=row_of)
    rel.update(rows)
    return rel


def _path(warm: np.ndarray, roles: list[str], backbone: int) -> np.ndarray:
    """Warm-up along the longest path: slowest encoder, the backbone, slowest generator."""
    out = warm[..., backbone].copy()
    for role in ("encoder", "generator"):
        cols = [i for i, r in enumerate(roles) if r == role]
        if cols:
            out += warm[..., cols].max(axis=-1)
    return out


# Bisection steps of the fill: to a relative 1e-9 of its range. The search first runs
# _COARSE_STEPS on every candidate (a valid, looser bound) and the rest only on those
# whose coarse bound may beat the best layout (``Relaxation.refine``).
_FILL_STEPS = 36
_COARSE_STEPS = 10


class _Fill:
    """Per row, a lower bound of the slowest stage's time over integer layouts: the
    least t at which giving every unit the fewest stages that reach it fits the budget.
    A unit's stage time is k_u ceil(L_u / pp_u) / L_u, plus ``hop_u`` (activations out,
    gradients back) when pp_u > 1, and pp_u is at least its memory floor. Integer stage
    sizes make this tighter than continuous water-filling (k_u / pp_u <= t), which it
    always dominates; it ignores the allowed-value sets and the sync and warm-up terms,
    so it never exceeds the true optimum.

    Found by bisection in log t, resumable per row: every row's steps depend on that row
    alone, so a row bisected in two goes (or within a subset of rows) ends exactly where
    it would in one."""

    def __init__(self, k, hop, layers, stage_gpus, pp_lo, pp_hi, budget) -> None:
        self.k = np.where(k > 0, k, 1e-30)
        self.hop, self.layers, self.stage_gpus = hop, layers, stage_gpus
        self.pp_lo, self.pp_hi, self.budget = pp_lo, pp_hi, budget
        self.lo_t = np.log((self.k / layers).max(axis=1) * 0.999)  # below one layer per stage
        self.hi_t = np.log((self.k + hop).max(axis=1) * 1.001)     # no more than one stage
        self.reachable = self._fits(slice(None), np.exp(self.hi_t))
        self.steps = np.zeros(len(self.k), dtype=int)

    def _fits(self, rows, t: np.ndarray) -> np.ndarray:
        k, hop, layers = self.k[rows], self.hop[rows], self.layers
        t = t[:, None]
        biggest = np.floor((t - hop) * layers / k)              # layers per stage allowed
        pp = np.where(k <= t, 1, np.ceil(layers / np.maximum(biggest, 1)))
        pp = np.maximum(pp, self.pp_lo[rows])
        ok = ((k <= t) | (biggest >= 1)) & (pp <= self.pp_hi[rows])
        # A floor above 1 brings the hops in.
        ok &= (pp == 1) | (k * np.ceil(layers / pp) / layers + hop <= t)
        return ok.all(axis=1) & ((self.stage_gpus[rows] * pp).sum(axis=1) <= self.budget)

    def bisect(self, rows, steps: int) -> None:
        """``steps`` more halvings of the rows' brackets (rows: an index array or a slice)."""
        lo_t, hi_t = self.lo_t[rows], self.hi_t[rows]
        for _ in range(steps):
            mid = (lo_t + hi_t) / 2
            ok = self._fits(rows, np.exp(mid))
            hi_t = np.where(ok, mid, hi_t)
            lo_t = np.where(ok, lo_t, mid)
        self.lo_t[rows], self.hi_t[rows] = lo_t, hi_t
        self.steps[rows] += steps

    def lower(self, rows) -> np.ndarray:
        """The rows' bounds so far: lo_t is infeasible, so below the true minimum."""
        return np.where(self.reachable[rows], np.exp(self.lo_t[rows]), np.inf)


# Stage-time levels the integer bound tries per candidate before its tail term.
_LEVELS = 6


class _IntegerBound:
    """A per-candidate lower bound that couples the three terms through integer depths.

    The closed-form bound takes the least steady stage time, the least warm-up and the
    least sync independently, so a candidate whose fastest layout needs many stages (a
    long warm-up) looks as good as one that needs few. Here, for each of the lowest
    ``_LEVELS`` stage times t a layout of the candidate can have (the units' T_u at their
    efficient depths, ``efficient_pps``: a dominated depth has the same T_u and sync and
    no shorter warm-up), every unit is held to the depths that reach t, between its
    memory floor and what the budget leaves once every other unit has its fewest such
    stages, and its warm-up and sync are taken at their least over those depths. The
    terms are ``Evaluator.evaluate``'s: 1F1B (or ZB-H1) warm-up with hops, ZeRO-1 sync, and an
    interleaved warm-up at DistTrain's T pp / v, below the evaluator's. A layout whose
    slowest stage is t is bounded by that level's value, one slower than every level by
    the closed-form rest at the next level's t. The least of these, never below the
    closed-form bound, bounds every layout of the candidate.
    """

    def __init__(self, space: Space, rel: Relaxation) -> None:
        self.space, self.rel = space, rel
        ev = space.evaluator
        self.roles = [u.role for u in space.units]
        depths = [efficient_pps(u.layers, space.pps(i)) for i, u in enumerate(space.units)]
        width = max(1, *(len(d) for d in depths))
        self.pp = np.zeros((space.n, width), dtype=int)      # 0: padding
        for i, d in enumerate(depths):
            self.pp[i, :len(d)] = d
        self.fwd_bwd = {(i, t): sum(ev.fwd_bwd(i, t))
                        for i in range(space.n) for t in space.tps(i)}
        self.bwd = {(i, t): ev.fwd_bwd(i, t)[1] for i in range(space.n) for t in space.tps(i)}

    def __call__(self, cands: np.ndarray) -> np.ndarray:
        space, rel, ev = self.space, self.rel, self.space.evaluator
        cost, b, n = ev.cost, space.backbone, space.n
        tp, dp = rel.candidates.tp[cands], rel.candidates.dp[cands]
        dp_lm = dp[:, b]
        m = ev.total_microbatches // dp_lm
        share = dp_lm[:, None] / dp
        stage = tp * dp * space.cps
        pp = self.pp[None, :, :]                                  # (1, n, P)
        # T, W and S of every unit at every efficient depth: (c, n, P), as Evaluator has them.
        shape = (len(cands), n, self.pp.shape[1])
        t_stage, warm, sync = np.empty(shape), np.empty(shape), np.empty(shape)
        for i, unit in enumerate(space.units):
            c = np.array([self.fwd_bwd[i, int(x)] for x in tp[:, i]])
            bwd = np.array([self.bwd[i, int(x)] for x in tp[:, i]])
            hop = cost.hop_time_s(unit, tp[:, i], share[:, i])[:, None]
            p = self.pp[i][None, :]
            part = np.ceil(unit.layers / np.maximum(p, 1)) / unit.layers
            t = (share[:, i] * c)[:, None] * part + np.where(p > 1, 2 * hop, 0.0)
            wgt = ev.weight_s(i, (share[:, i] * bwd)[:, None] * part)     # zero_bubble
            v = ev.vpp(i, np.maximum(p, 1), m[:, None])
            t_stage[:, i] = t
            # Interleaved: DistTrain's T pp / v, below Evaluator's T (1 + (pp - 1) / v) and
            # below any schedule that sends one microbatch through pp v chunks of T / v.
            interleaved = t * p / v
            warm[:, i] = np.where(v > 1, interleaved, t + (t - 2 * wgt) * (p - 1) / v) + \
                2 * (p - 1) * hop
            sync[:, i] = cost.dp_sync_time_s(unit, tp[:, i][:, None], np.maximum(p, 1),
                                             dp[:, i][:, None])
        valid = (pp > 0) & (pp >= rel.pp_lo[cands][:, :, None]) & \
            (pp <= rel.pp_hi[cands][:, :, None])
        for i in range(n):
            valid[:, i] &= space.gpus_allowed(i, stage[:, i][:, None] * self.pp[i][None, :])
        # The levels: the lowest stage times at or above the fill's (a lower bound of any
        # layout's slowest stage), the first _LEVELS of them tried, the next one the tail.
        t_low = rel.fill.lower(rel.fill_row[cands])
        flat = np.where(valid & (t_stage >= t_low[:, None, None] * (1 - 1e-6)), t_stage, np.inf)
        flat = flat.reshape(len(cands), -1)
        count = min(_LEVELS + 1, flat.shape[1])
        levels = np.sort(np.partition(flat, count - 1, axis=1)[:, :count], axis=1)
        tau, tail = levels[:, :_LEVELS], levels[:, _LEVELS] if count > _LEVELS else \
            np.full(len(cands), np.inf)
        # (c, K, n, P): which depths reach each level.
        reach = valid[:, None] & (t_stage[:, None] <= tau[:, :, None, None])
        big = np.iinfo(self.pp.dtype).max // 4
        fewest = np.where(reach, pp[:, None], big).min(axis=-1)   # (c, K, n)
        ok = (fewest < big).all(axis=-1)
        fewest = np.where(fewest < big, fewest, 0)
        used = (stage[:, None] * fewest).sum(axis=-1)            # (c, K)
        ok &= used <= space.num_gpus
        room = (space.num_gpus - used)[..., None] + stage[:, None] * fewest
        most = np.minimum(room // stage[:, None], rel.pp_hi[cands][:, None])
        reach &= pp[:, None] <= most[..., None]
        least_warm = np.where(reach, warm[:, None], np.inf).min(axis=-1)
        least_sync = np.where(reach, sync[:, None], np.inf).min(axis=-1)
        m1 = rel.steady_mult[cands]
        with np.errstate(invalid="ignore"):
            value = _path(least_warm, self.roles, b) + ev.edge_s + m1[:, None] * tau + \
                least_sync.max(axis=-1)
            value = np.where(ok & np.isfinite(tau), value, np.inf).min(axis=1)
            # Slower layouts: the closed-form rest at the tail level's stage time.
            rest = rel.head[cands] + m1 * tail + rel.sync_least[cands]
            rest = np.where(np.isfinite(tail), rest, np.inf)
        return np.maximum(np.minimum(value, rest), rel.bound[cands])


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

    def solve(self, rel: Relaxation, c: int, budget: int, *,
              precise: bool = False) -> tuple[np.ndarray, float]:
        """The relaxed optimum of candidate ``c``: GPU counts and objective (without the
        constant edge transfers); ``precise``: to tighter tolerances. Raises PlannerError
        when the solver does not converge."""
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
                self.problem.solve(solver=_SOLVER, **(_PRECISE if precise else {}))
        except cp.error.SolverError as exc:
            raise PlannerError(f"the convex solver failed on a candidate: {exc}") from exc
        if self.problem.status not in _ACCEPTED:
            raise PlannerError(f"the convex solver returned '{self.problem.status}' for a "
                               "candidate whose memory floors fit the budget")
        g = np.asarray(self.x.value, dtype=float) * budget
        return g, float(self.problem.value)


def _recheck(rel: Relaxation, c: int, g: np.ndarray, value: float, budget: int,
             roles: list[str], backbone: int) -> bool:
    """Re-verify the solver's answer in plain numpy: feasible (else PlannerError), and
    whether its objective is the one reported."""
    slack = 1e-5 * max(budget, 1)
    if g.sum() > budget + slack or (g < rel.lo[c] - slack).any() or \
            (g > rel.hi[c] + slack).any():
        raise PlannerError("the convex solver's answer violates its constraints")
    warm = rel.warm[c] - rel.hop0[c] + rel.hop[c] * g
    objective = _path(warm[None, :], roles, backbone)[0] + \
        rel.steady_mult[c] * (rel.a[c] / g).max() + (rel.sync0[c] + rel.sync1[c] / g).max()
    return math.isclose(objective, value, rel_tol=1e-3, abs_tol=1e-6)


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
        ok = ok & space.gpus_allowed(i, tps[i] * dps[i] * space.cps[i] * grids[i])
    size = int(ok.size)
    if not ok.any():
        return None, size
    times = np.where(ok, est.iteration_time_s, np.inf)
    k = np.unravel_index(np.argmin(times), times.shape)
    pps = tuple(int(p[j]) for p, j in zip(pp_lists, k, strict=True))
    return Layout(tp=tuple(tps), dp=tuple(dps), pp=pps, iteration_time_s=float(times[k])), size


# The first wave of the search refines the candidates whose coarse bound is within this
# of the least; the next ones, all those that may still beat the best layout found.
_FIRST_WAVE = 1e-2
# Chunks of the integer bound: candidates bounded together, in the order they are visited.
_CHUNK = 64
# Round-off between the bounds' sums and Evaluator's, relative.
_SLACK = 1e-9


def plan_convex(cost: CostModel, num_gpus: int | None = None, *, tolerance: float = 1e-3,
                progress: Progress | None = None) -> Plan:
    """Algorithm 1: the layout with the least predicted iteration time, found by
    branch and bound over the candidates with one convex program per candidate
    that survives the bounds. Raises ``Infeasible`` when no layout fits, naming the
    binding constraint, and ``PlannerError`` when the solver misbehaves.

    Candidates are visited in the order of the closed-form bound, and the search stops
    at the first whose bound is within ``tolerance`` of the best layout. A visited
    candidate whose integer bound (``_IntegerBound``) is no less than the best layout
    cannot improve on it and skips its convex program and repair; the others go on as
    before, so the search ends with the same layout as without the integer bound, having
    solved and evaluated less. The closed-form bound is computed coarsely for every
    candidate and exactly only for those that may be visited (``Relaxation.refine``),
    in waves whose union is exactly the prefix of the full order that is visited."""
    start = time.perf_counter()
    num_gpus = num_gpus or cost.program.cluster.num_gpus
    ev = Evaluator(cost, num_gpus)
    space = Space(ev)
    cands = space.candidates()
    if not len(cands):
        raise no_layout_fits(space)
    rel = relaxation_bounds(space, cands, coarse=True)
    roles = [u.role for u in space.units]
    pending = np.flatnonzero(np.isfinite(rel.bound))        # not yet refined
    if not len(pending):
        raise no_layout_fits(space)
    total = len(pending)
    integer_bound = _IntegerBound(space, rel)
    search = _Candidates(space, ev, rel, _ConvexProgram(roles, space.backbone), cands,
                         num_gpus, tolerance)
    best: Layout | None = None
    visited = 0
    threshold = float(rel.bound[pending].min()) * (1 + _FIRST_WAVE)
    waiting = pending[:0]                                   # refined, not yet visited
    while len(pending) or len(waiting):
        # Refine every candidate whose coarse bound is below the threshold: the rest have
        # exact bounds at or above it, so the refined ones below it come first in the full
        # order, and in the same order among themselves (ties by index, as a stable sort).
        take = rel.bound[pending] < threshold
        rel.refine(pending[take])
        wave = np.sort(np.concatenate([waiting, pending[take]]))
        pending = pending[~take]
        ready = rel.bound[wave] < threshold
        wave, waiting = wave[ready], wave[~ready]
        wave = wave[np.argsort(rel.bound[wave], kind="stable")]
        stop = False
        for at in range(0, len(wave), _CHUNK):
            chunk = wave[at:at + _CHUNK]
            if best is not None and rel.bound[chunk[0]] >= best.iteration_time_s * \
                    (1 - tolerance):
                stop = True
                break
            for c, floor in zip(chunk, integer_bound(chunk), strict=True):
                if best is not None and rel.bound[c] >= best.iteration_time_s * (1 - tolerance):
                    stop = True
                    break
                if progress is not None:
                    progress(visited, total, f"{search.solves} convex solves")
                visited += 1
                best = search.visit(c, float(floor), best)
            if stop:
                break
        if stop:
            break
        # The next wave: every candidate that may still beat the best layout.
        if best is not None:
            if threshold >= best.iteration_time_s * (1 - tolerance):
                break
            threshold = best.iteration_time_s * (1 - tolerance)
        else:
            rest = np.concatenate([rel.bound[pending], rel.bound[waiting]])
            if not len(rest):
                break
            threshold = np.nextafter(max(threshold * (1 + 4 * _FIRST_WAVE), rest.min()),
                                     np.inf)
    if progress is not None:
        progress(total, total, f"{search.solves} convex solves")
    if best is None:
        raise no_layout_fits(space)
    return make_plan(ev, "convex", best, solve_time_s=time.perf_counter() - start,
                     candidates=len(cands), convex_solves=search.solves,
                     evaluated=search.evaluated)


@dataclass
class _Candidates:
    """``plan_convex``'s work on one candidate (``visit``), with what it counts: convex
    programs solved and layouts evaluated by the repair."""

    space: Any
    ev: Evaluator
    rel: Any
    program: Any
    cands: Any
    num_gpus: int
    tolerance: float
    solves: int = 0
    evaluated: int = 0

    def visit(self, c: int, floor: float, best: Layout | None) -> Layout | None:
        """Candidate ``c`` of integer bound ``floor`` against ``best`` so far: skipped
        when no layout of it can beat ``best``, else its convex program and the repair
        around its answer; the better of ``best`` and what it found."""
        rel, space, num_gpus = self.rel, self.space, self.num_gpus
        roles = [u.role for u in space.units]
        if best is not None and floor * (1 - _SLACK) >= best.iteration_time_s:
            return best         # no layout of this candidate beats the best one
        g, value = self.program.solve(rel, c, num_gpus)
        self.solves += 1
        if not _recheck(rel, c, g, value, num_gpus, roles, space.backbone):
            g, value = self.program.solve(rel, c, num_gpus, precise=True)
            if not _recheck(rel, c, g, value, num_gpus, roles, space.backbone):
                # Its value is no bound: repair around its answer, prune nothing.
                value = -math.inf
        if best is not None and value + self.ev.edge_s >= best.iteration_time_s * \
                (1 - self.tolerance):
            return best
        cands = self.cands
        tps, dps = tuple(int(x) for x in cands.tp[c]), tuple(int(x) for x in cands.dp[c])
        layout, n_eval = repair(space, tps, dps, rel.pp_lo[c], rel.pp_hi[c],
                                g / (cands.tp[c] * cands.dp[c] * space.cps))
        self.evaluated += n_eval
        if layout is None:
            return best
        if layout.iteration_time_s < floor * (1 - _SLACK):
            raise PlannerError(
                f"the integer bound ({floor:.6g} s) exceeds a layout's exact cost "
                f"({layout.iteration_time_s:.6g} s): it no longer matches Evaluator")
        return layout if best is None or layout.iteration_time_s < best.iteration_time_s \
            else best
