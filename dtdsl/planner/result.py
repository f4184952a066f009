"""What every planner returns: a ``Plan`` built from the winning integer layout, or an
``Infeasible`` that names the binding constraint."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from dtdsl.codes import DT410
from dtdsl.ir.plan import Plan, UnitPlan, split_layers
from dtdsl.report import format_bytes
from dtdsl.source import Span

__all__ = ["Infeasible", "Layout", "PlannerError", "make_plan", "no_layout_fits"]


class PlannerError(RuntimeError):
    """The solver misbehaved (did not converge, or its answer failed the re-check).
    A compiler bug or a numerically hostile spec, never a silent fallback."""


@dataclass(eq=False)   # not frozen: raising an exception sets its __traceback__
class Infeasible(Exception):
    """No layout fits; ``message`` names the binding constraint, ``span`` the spec line."""

    message: str
    span: Span | None
    notes: tuple[str, ...] = ()
    hint: str | None = None
    code: str = DT410

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class Layout:
    """An integer layout and its exact predicted iteration time."""

    tp: tuple[int, ...]
    dp: tuple[int, ...]
    pp: tuple[int, ...]
    iteration_time_s: float
    replicated: tuple[bool, ...] = field(default=())
    chained: bool = False


def make_plan(ev, search: str, layout: Layout, *, solve_time_s: float, candidates: int,
              convex_solves: int, evaluated: int) -> Plan:
    """The Plan of ``layout``, re-evaluated in full by the evaluator ``ev``."""
    program = ev.cost.program
    n = len(ev.units)
    replicated = layout.replicated or (False,) * n
    est = ev.evaluate(layout.tp, layout.dp, layout.pp, replicated=replicated,
                      chained=layout.chained)
    dp_lm = layout.dp[ev.backbone]
    units = []
    for i, unit in enumerate(ev.units):
        tp, dp, pp = layout.tp[i], layout.dp[i], layout.pp[i]
        share = dp_lm / dp
        # Placed and priced as the evaluator placed and priced it (``place_units``).
        across = bool(est.tp_across_nodes[i])
        fwd, bwd = ev.fwd_bwd(i, 1 if replicated[i] else tp, across)
        heaviest = math.ceil(unit.layers / pp) / unit.layers
        if unit.role == "encoder":
            projectors = tuple(p.name for p in program.projectors if p.source == unit.name)
        elif unit.role == "generator":
            projectors = tuple(p.name for p in program.projectors if p.target == unit.name)
        else:
            projectors = ()
        cp = ev.cps[i]
        gpus = tp * cp * dp * pp
        units.append(UnitPlan(
            name=unit.name, role=unit.role, projectors=projectors, gpus=gpus, tp=tp, dp=dp,
            pp=pp, vpp=int(np.asarray(est.vpp[i])), tp_replicated=replicated[i],
            recompute=program.module(unit.name).recompute,
            first_rank=int(est.first_rank[i]), tp_across_nodes=across,
            layers_per_stage=split_layers(unit.layers, pp),
            microbatch_share=share, fwd_time_s=share * fwd * heaviest,
            bwd_time_s=share * bwd * heaviest,
            dp_sync_time_s=float(ev.cost.dp_sync_time_s(
                unit, 1 if replicated[i] else tp, pp, dp,
                replicated_over=tp if replicated[i] else 1)),
            memory_bytes=float(est.memory_bytes[i]), memory_limit_bytes=ev.memory_limit[i],
            cp=cp, ep=unit.ep))
    iteration = float(est.iteration_time_s)
    assert bool(est.feasible), "planners return feasible layouts"
    assert math.isclose(iteration, layout.iteration_time_s, rel_tol=1e-9), \
        (iteration, layout.iteration_time_s)
    train = program.train
    return Plan(
        spec=program.name, spec_sha256=program.source_sha256, search=search,
        num_gpus=ev.num_gpus, gpus_used=int(est.gpus), global_batch=train.global_batch,
        micro_batch=train.micro_batch, num_microbatches=ev.microbatches(dp_lm),
        schedule=train.schedule, iteration_time_s=iteration,
        warmup_time_s=float(est.warmup_s), steady_time_s=float(est.steady_s),
        dp_sync_time_s=float(est.sync_s),
        model_flops_per_iteration=ev.model_flops_per_iteration, mfu=ev.mfu(iteration),
        mfu_full_attention=ev.mfu(iteration, full_attention=True),
        solve_time_s=solve_time_s, candidates=candidates, convex_solves=convex_solves,
        evaluated=evaluated,
        units=tuple(units))


def _limit(limit: float, gpu_memory: float) -> str:
    """"15.0 MiB per GPU (0.37% of 4.0 GiB)": a small share to two decimals, not 0%."""
    share = limit / gpu_memory
    percent = f"{share:.0%}" if share >= 0.01 else f"{share:.2%}"
    return f"{format_bytes(limit)} per GPU ({percent} of {format_bytes(gpu_memory)})"


def _cp_hint(program, unit) -> str:
    """Where the unit runs without context parallelism and has a sequence to split: the
    constraint that lets the planner split it (activations / cp)."""
    if unit.cp > 1 or program.constraints_for(unit.name).cp.candidates(2) != (1,) or \
            program.module(unit.name).arch.kind == "unet":
        return ""
    return f", or allow context parallelism: `cp({unit.name}) in {{1, 2, 4, 8}}`"


def _constrained_counts(space, i: int) -> dict[int, str]:
    """Unit i's GPU counts (tp x cp x pp x dp, within the budget) at which it fits in
    memory, over every allowed TP, pipeline depth and DP, with one such layout each."""
    counts: dict[int, str] = {}
    cp = int(space.evaluator.cps[i])
    tps = space.tps(i)
    for lm in space.dp_lms():
        for dp in space.dps(i, lm):
            fits = space.smallest_fitting_pp(i, np.array(tps), np.full(len(tps), dp),
                                             np.full(len(tps), lm))
            for tp, first in zip(tps, fits, strict=True):
                for pp in (p for p in space.pps(i) if first and p >= first):
                    if tp * cp * pp * dp <= space.num_gpus:
                        counts.setdefault(tp * cp * pp * dp, f"tp {tp} x pp {pp} x dp {dp}")
    return counts


def no_layout_fits(space) -> Infeasible:
    """Why nothing fits: a module that fits in memory at no allowed TP and PP, or the
    modules' smallest fitting layouts need more GPUs together than the budget."""
    program = space.program
    ev = space.evaluator
    cluster = program.cluster
    gpu_memory = cluster.gpu.memory_bytes
    lm = (space.dp_lms() or (1,))[0]
    needs: list[tuple[str, int, str]] = []
    for i, unit in enumerate(space.units):
        limit = ev.memory_limit[i]
        dp = lm if i == space.backbone else (space.dps(i, lm) or (1,))[0]
        tps = space.tps(i) or (1,)
        fits = space.smallest_fitting_pp(i, np.array(tps), np.full(len(tps), dp),
                                         np.full(len(tps), lm))
        options = [(t * ev.cps[i] * dp * int(p), t, int(p))
                   for t, p in zip(tps, fits, strict=True) if p]
        if not options:
            top_pp = max(space.pps(i) or (1,))
            mem = float(ev.cost.memory_bytes(
                unit, max(tps), top_pp, dp, ev.vpp(i, top_pp),
                top_pp + space.min_downstream_pp(i), space.total_microbatches // lm, lm / dp))
            return Infeasible(
                f"{unit.name} does not fit in {_limit(limit, gpu_memory)} at any allowed "
                f"layout: even at tp {max(tps)} and pp {top_pp} its first pipeline stage "
                f"needs {format_bytes(mem)}",
                program.module(unit.name).span,
                notes=(f"{unit.name}: {unit.params / 1e9:.2f}B parameters, {unit.layers} "
                       "pipeline layers",),
                hint="allow larger tp or pp, raise the memory share, use a smaller micro_batch "
                     "or set `recompute = selective` (or `full`)" + _cp_hint(program, unit))
        cp = f" x cp {unit.cp}" if unit.cp > 1 else ""
        domain = space.constraints[i].gpus
        if domain.low == 1 and domain.high is None and domain.values is None:
            gpus, tp, pp = min(options)
            needs.append((unit.name, gpus, f"tp {tp}{cp} x pp {pp} x dp {dp}", ""))
            continue
        counts = _constrained_counts(space, i)
        allowed = {g: how for g, how in counts.items() if space.gpus_allowed(i, g)}
        if not allowed:
            return Infeasible(
                f"{unit.name}'s constraint gpus in {domain.describe()} allows none of its "
                f"layouts on {space.num_gpus} GPUs",
                program.module(unit.name).span,
                notes=(f"{unit.name} fits in memory on "
                       + (", ".join(map(str, sorted(counts))) or "no count") + " GPUs "
                       "(tp x pp x dp within its other constraints)",),
                hint=f"allow one of those counts in gpus({unit.name})")
        gpus = min(allowed)
        constraint = f"gpus({unit.name}) in {domain.describe()}"
        needs.append((unit.name, gpus, f"{allowed[gpus]}{cp}, {constraint}", constraint))
    total = sum(n[1] for n in needs)
    notes = tuple(f"{n}: at least {g} GPU{'s' if g != 1 else ''} ({how})"
                  for n, g, how, _ in needs)
    span = cluster.gpus_span or cluster.span
    if space.num_gpus != cluster.num_gpus:
        notes += (f"planned for {space.num_gpus} GPUs (the spec's cluster has "
                  f"{cluster.num_gpus})",)
    if total > space.num_gpus:
        name, most, _, constraint = max(needs, key=lambda x: x[1])
        i = [u.name for u in space.units].index(name)
        limit = ev.memory_limit[i]
        why = f"({constraint})" if constraint else \
            f"to fit in {_limit(limit, gpu_memory)} at tp <= {max(space.tps(i))}"
        return Infeasible(
            f"{name} needs at least {most} GPUs {why}; "
            f"all modules together need at least {total}, the cluster has {space.num_gpus}",
            span, notes=notes,
            hint=f"give the cluster at least {total} GPUs, or "
                 + (f"loosen {constraint}" if constraint else "allow larger tp or pp"))
    return Infeasible(f"no layout satisfies the constraints together on {space.num_gpus} GPUs",
                      span, notes=notes, hint="loosen the dp, pp or gpus constraints")
