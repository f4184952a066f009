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

import itertools
import time
from dataclasses import dataclass

import numpy as np

from dtdsl.cost.model import CostModel
from dtdsl.ir.plan import PLACEMENTS, Plan, place_units
from dtdsl.planner.baseline import Colocation, colocated_plan
from dtdsl.planner.evaluate import Evaluator
from dtdsl.planner.space import Space

__all__ = ["PLACEMENTS", "colocated_layouts", "colocation_refusal", "plan_fits"]


def colocation_refusal(cost: CostModel, placement: str = "colocated") -> str | None:
    """Why no ``placement`` ("colocated" or "phased") layout of ``cost``'s program can
    exist (None when one may): no encoder or generator to co-locate (no encoder to run
    phased), a constraint that gives one GPUs of its own or more than one stage, or
    (phased) one that gives another module more than one stage (beside a phased encoder a
    module is co-located or takes one stage of its own)."""
    space = Space(Evaluator(cost, cost.program.cluster.num_gpus))
    others = [i for i in range(space.n) if i != space.backbone]
    if placement == "phased":
        encoders = [i for i in others if space.units[i].role == "encoder"]
        if not encoders:
            return "the spec has no encoder to run phased"
        reasons = [_shared_refusal(space, i) for i in encoders]
        if all(reasons):
            return reasons[0]
        for i in others:
            if 1 not in space.pps(i):
                return f"{space.units[i].name} is constrained to more than one pipeline stage"
        return None
    if not others:
        return "the spec has no encoder or generator to co-locate"
    for i in others:
        reason = _shared_refusal(space, i)
        if reason:
            return reason
    return None


def _shared_refusal(space: Space, i: int) -> str | None:
    """Why module ``i`` cannot run on the backbone's GPUs (None when it can): a constraint
    that gives it more than one stage or GPUs of its own."""
    name = space.units[i].name
    if 1 not in space.pps(i):
        return f"{name} is constrained to more than one pipeline stage"
    gpus = space.constraints[i].gpus
    if gpus.values is not None or gpus.high is not None or gpus.low > 1:
        return f"{name} is constrained to GPUs of its own (a gpus constraint)"
    return None


def colocated_layouts(cost: CostModel, num_gpus: int | None = None, *,
                      search: str = "convex", placement: str = "colocated") -> list[Plan]:
    """Per set of co-located modules and backbone depth, the fastest layout of ``cost``'s
    program at mean work that fits, fastest first; empty where none fits or
    ``colocation_refusal`` names a reason. Every non-empty set of encoders and generators
    is tried (up to ``_SUBSETS`` of them): the modules in it share the backbone's stages,
    the others take GPUs of their own beside it (``_Mixed``). A co-located module is
    split by the backbone's TP groups, or replicated over them where it cannot be
    (``Colocation.replicated``); every backbone TP, every backbone DP that each of them
    allows, the depths that are not dominated (``Space.depths``: every allowed one under a
    ``gpus`` constraint, which may need a dominated one). ``search``: the
    Plans' search field. ``placement`` "phased": every non-empty set of encoders runs
    phased on the backbone's GPUs (``Colocation``'s ``phased``), with every set of the
    other modules co-located as above."""
    start = time.perf_counter()
    num_gpus = num_gpus or cost.program.cluster.num_gpus
    if colocation_refusal(cost, placement) is not None:
        return []
    ev = Evaluator(cost, num_gpus)
    space = Space(ev)
    b = space.backbone
    others = [i for i in range(space.n) if i != b]
    pps = np.asarray(space.depths(b), dtype=int)
    dp_lms = space.dp_lms()
    counts = tuple(space.total_microbatches // dp for dp in dp_lms)
    best: dict[tuple[frozenset[int], frozenset[int], int], _Choice] = {}
    candidates = evaluated = 0
    for here, phased in _arrangements(space, others, placement):
        mixed = _Mixed(space, Colocation(ev, counts, colocated=here, phased=phased))
        to_beat: dict[int, float] = {}      # per depth, this arrangement's best time so far
        for tp in space.tps(b):
            for dp in dp_lms:
                if tp * dp > num_gpus or any(dp not in space.dps(i, dp) for i in here):
                    continue
                candidates += 1
                evaluated += int(pps.size)
                for choice in mixed.best(tp, dp, pps, to_beat):
                    key = (here, phased, choice.pp)
                    if key not in best or choice.time < best[key].time:
                        best[key] = choice
                        to_beat[choice.pp] = choice.time
    solve = time.perf_counter() - start
    plans = [c.mixed.plan(c, search=search, solve_time_s=solve, candidates=candidates,
                          evaluated=evaluated) for c in best.values()]
    return sorted(plans, key=lambda x: (x.iteration_time_s, x.units[b].pp,
                                        -sum(u.colocated for u in x.units)))


def _subsets(items: list[int], *, empty: bool = False) -> list[frozenset[int]]:
    """Every subset of ``items``, the largest first (the empty one last where asked)."""
    return [frozenset(c) for k in range(len(items), -1 if empty else 0, -1)
            for c in itertools.combinations(items, k)]


def _arrangements(space: Space, others: list[int], placement: str
                  ) -> list[tuple[frozenset[int], frozenset[int]]]:
    """(co-located, phased) sets of modules tried, at most ``_SUBSETS``: "colocated" every
    non-empty set co-located; "phased" every non-empty set of encoders phased, with every
    set of the others co-located (none included)."""
    if placement == "colocated":
        return [(here, frozenset()) for here in _subsets(others)][:_SUBSETS]
    shared = [i for i in others if _shared_refusal(space, i) is None]
    encoders = [i for i in shared if space.units[i].role == "encoder"]
    return [(here, phased) for phased in _subsets(encoders)
            for here in _subsets([i for i in shared if i not in phased], empty=True)
            ][:_SUBSETS]


# Sets of co-located modules tried: all of them, then every smaller set (a spec has at most
# a few encoders and generators; this bounds a spec with many).
_SUBSETS = 16


@dataclass(frozen=True)
class _Own:
    """A module on GPUs of its own beside a co-located backbone: one stage, ``tp`` x
    ``dp``, its time per backbone microbatch step and end of step."""

    index: int
    tp: int
    dp: int
    stage_s: float
    sync_s: float
    memory: float


@dataclass(frozen=True)
class _Choice:
    mixed: _Mixed
    tp: int
    dp: int
    pp: int
    split: tuple[int, ...]
    own: tuple[_Own, ...]
    time: float
    warmup: float
    steady: float
    sync: float


class _Mixed:
    """Layouts with some modules on the backbone's stages (``Colocation``) and the others
    on one stage of their own each. Its time: the backbone's 1F1B over its uneven stages,
    or where a module of its own is slower, that module's steady work after the first
    microbatch crossed the backbone; plus the own modules' warm-up (the slowest encoder
    before, the slowest generator after) and their transfers, plus the slowest end of
    step."""

    def __init__(self, space: Space, co: Colocation) -> None:
        self.space = space
        self.co = co
        ev = co.ev
        here = set(co.enc) | set(co.gen) | set(co.phase)
        self.own = [i for i in range(space.n) if i != ev.backbone and i not in here]
        enc = [i for i in self.own if ev.roles[i] == "encoder"]
        gens = [i for i in self.own if ev.roles[i] == "generator"]
        self.own_enc, self.own_gen = enc, gens
        cost = ev.cost
        self._memo: dict[tuple[int, int, int], list[_Own]] = {}
        self.edge_s = (2 * cost.p2p_time_s(max(ev.units[i].boundary_bytes for i in enc))
                       if enc else 0.0) + \
            (2 * cost.p2p_time_s(ev.units[ev.backbone].boundary_bytes) if gens else 0.0)

    def _options(self, i: int, dp_lm: int, pp_b: int) -> list[_Own]:
        """Unit ``i``'s one-stage layouts that fit, fastest first."""
        space, ev = self.space, self.co.ev
        cost, unit = ev.cost, ev.units[i]
        m = ev.microbatches(dp_lm)
        # A microbatch per stage downstream in flight: the backbone's and the generators'.
        depth = 1 + (pp_b + (1 if self.own_gen else 0) if ev.roles[i] == "encoder" else 0)
        key = (i, dp_lm, depth)
        if key in self._memo:
            return self._memo[key]
        out = self._memo[key] = []
        for tp in space.tps(i):
            for dp in space.dps(i, dp_lm):
                if not bool(space.gpus_allowed(i, tp * dp)):
                    continue
                share = dp_lm / dp
                mem = float(cost.memory_bytes(unit, tp, 1, dp, 1, depth, m, share))
                if mem > ev.memory_limit[i]:
                    continue
                fwd, bwd = ev.fwd_bwd(i, tp)
                out.append(_Own(index=i, tp=tp, dp=dp, stage_s=share * (fwd + bwd),
                                sync_s=float(cost.dp_sync_time_s(unit, tp, 1, dp)),
                                memory=mem))
        out.sort(key=lambda o: (o.stage_s, o.tp * o.dp))
        return out

    def best(self, tp: int, dp: int, pps: np.ndarray,
             to_beat: dict[int, float] | None = None) -> list[_Choice]:
        """The fastest layout at each backbone depth that fits (none where none does), or
        that is faster than ``to_beat[depth]`` where given: a depth whose time without the
        phased encoders' exposure (never negative) already reaches it is not priced
        further (their greedy is most of a search's time)."""
        co, ev = self.co, self.co.ev
        m = ev.microbatches(dp)
        # The phased encoders' exposure (a greedy over the microbatches) only for the
        # layouts that fit: the same figures, far fewer placements priced.
        figures = co.evaluate(tp, dp, pps, with_phases=False)
        out = []
        for k, p in enumerate(pps.tolist()):
            if not np.isfinite(figures.time[k]) or \
                    not bool(self.space.gpus_allowed(ev.backbone, tp * dp * p)):
                continue
            split = figures.splits[k]
            if not co.memory(tp, dp, p, split, 1 if self.own_gen else 0)[0]:
                continue
            options = [self._options(i, dp, p) for i in self.own]
            if any(not o for o in options):
                continue
            # Each term of the time below is at least its part here (float sums of
            # nonnegative terms are monotone), so no layout of this depth can beat it.
            if to_beat is not None and p in to_beat and float(figures.time[k] - figures.sync[k]) \
                    + self.edge_s + float(figures.sync[k]) >= to_beat[p]:
                continue
            pipeline = float(figures.time[k] - figures.sync[k]) + \
                co.bubbles_s(tp, p, bool(figures.across[k]), split, m)
            work = co._work(tp, bool(figures.across[k]))
            hop = work.hop if p > 1 else 0.0
            crossing = sum((work.fwd + work.bwd) * n + 2 * hop for n in split) + \
                sum(work.first) + sum(work.last)
            found = None
            for own in itertools.product(*options):
                gpus = tp * dp * p + sum(o.tp * o.dp for o in own)
                if gpus > ev.num_gpus:
                    continue
                slowest = max((o.stage_s for o in own), default=0.0)
                warm = max((o.stage_s for o in own if o.index in self.own_enc), default=0.0) \
                    + max((o.stage_s for o in own if o.index in self.own_gen), default=0.0) \
                    + self.edge_s
                body = max(pipeline, slowest * (m - 1) + crossing)
                sync = max([float(figures.sync[k])] + [o.sync_s for o in own])
                t = body + warm + sync
                if found is None or t < found.time:
                    found = _Choice(mixed=self, tp=tp, dp=dp, pp=p, split=split, own=own,
                                    time=t, warmup=t - sync - min(body, slowest * (m - 1)),
                                    steady=min(body, slowest * (m - 1)) if own else
                                    float(figures.steady[k]), sync=sync)
            if found is not None:
                out.append(found)
        return out

    def plan(self, c: _Choice, *, search: str, solve_time_s: float, candidates: int,
             evaluated: int) -> Plan:
        """The Plan of choice ``c``: the backbone and the own modules on ranks placed by
        ``place_units``, the co-located modules listed on the backbone's (``gpus`` 0)."""
        co, ev = self.co, self.co.ev
        b = ev.backbone
        base = colocated_plan(co, c.tp, c.dp, c.pp, search=search, padding="longest",
                              solve_time_s=solve_time_s, candidates=candidates,
                              evaluated=evaluated)
        if not c.own:
            return base
        own = {o.index: o for o in c.own}
        placed_units = [b] + sorted(own)
        placed = place_units([c.tp if i == b else own[i].tp for i in placed_units],
                             [c.tp * c.dp * c.pp if i == b else own[i].tp * own[i].dp
                              for i in placed_units], ev.gpus_per_node)
        first = dict(zip(placed_units, (int(x) for x in placed.first_rank), strict=True))
        across = dict(zip(placed_units, (bool(x) for x in placed.across_nodes),
                          strict=True))
        units = []
        for i, u in enumerate(base.units):
            if i == b:
                units.append(u.model_copy(update={"first_rank": first[b]}))
            elif i in own:
                o = own[i]
                x = across[i] and o.tp > 1
                fwd, bwd = ev.fwd_bwd(i, o.tp, x)
                share = c.dp / o.dp
                units.append(u.model_copy(update={
                    "gpus": o.tp * o.dp, "tp": o.tp, "dp": o.dp, "pp": 1, "colocated": False,
                    "tp_replicated": False, "first_rank": first[i], "tp_across_nodes": x,
                    "microbatch_share": share, "fwd_time_s": share * fwd,
                    "bwd_time_s": share * bwd, "dp_sync_time_s": o.sync_s,
                    "memory_bytes": o.memory}))
            else:
                units.append(u.model_copy(update={"first_rank": first[b]}))
        return base.model_copy(update={
            "units": tuple(units), "gpus_used": int(placed.span),
            "iteration_time_s": c.time, "warmup_time_s": c.warmup,
            "steady_time_s": c.steady, "dp_sync_time_s": c.sync, "mfu": ev.mfu(c.time),
            "mfu_full_attention": ev.mfu(c.time, full_attention=True)})


def plan_fits(cost: CostModel, plan: Plan) -> bool:
    """Whether ``plan``'s layout fits in memory priced by ``cost`` (a cost model of its
    modules, under the plan's training settings or others): its own units' first stages,
    and for a co-located plan every backbone stage with the modules it hosts."""
    ev = Evaluator(cost, plan.num_gpus)
    units = {u.name: u for u in plan.units}
    order = [units[u.name] for u in ev.units]
    backbone = next(u for u in plan.units if u.role == "backbone")
    if plan.placement in ("colocated", "phased"):
        here = frozenset(i for i, u in enumerate(order) if u.colocated)
        phased = frozenset(i for i, u in enumerate(order) if u.phased)
        co = Colocation(ev, (plan.num_microbatches,), colocated=here, phased=phased)
        own_gen = any(u.role == "generator" and not u.colocated for u in order)
        if not co.memory(backbone.tp, backbone.dp, backbone.pp, backbone.layers_per_stage,
                         1 if own_gen else 0)[0]:
            return False
        mixed = _Mixed(Space(ev), co)
        for i in mixed.own:
            u = order[i]
            if not any((o.tp, o.dp) == (u.tp, u.dp)
                       for o in mixed._options(i, backbone.dp, backbone.pp)):
                return False
        return True
    est = ev.evaluate(tuple(u.tp for u in order), tuple(u.dp for u in order),
                      tuple(u.pp for u in order),
                      replicated=tuple(u.tp_replicated for u in order))
    return bool(est.feasible)
