"""The baseline: Megatron-LM's rigid orchestration, what users run today.

One TP degree and one DP degree for the whole model, one pipeline. Megatron-LM's
multimodal training (``examples/multimodal``) places an encoder in one of two ways, and
the baseline takes the faster that fits:

- **own stages** (``encoder_pipeline_model_parallel_size = 1``): the encoders and
  generators are extra pipeline stages before and after the backbone's, ONE stage each
  (its LLaVA model provider, ``examples/multimodal/model.py``, asserts
  ``encoder_pipeline_model_parallel_size <= 1``: "LLaVA does not support pp>1 for
  encoder on it's own pipeline rank"). A pipeline stage spans one TP group, and such a
  stage runs whole on every GPU of it (``tp_replicated``): TP buys it nothing. The
  encoders run one after another (``chained``).
- **co-located** (``encoder_pipeline_model_parallel_size = 0``): the encoders run on the
  GPUs of the backbone's first pipeline stage and the generators on its last, split by
  the backbone's TP; no GPU of their own, but the first (last) stage carries their time
  and memory.

Every unit has the backbone's DP and microbatch, and a sample stays on its replica's
pipeline (``Plan.rigid``). The spec's ``recompute`` settings apply, and where a layout
does not fit without it the baseline may recompute every layer, as a Megatron-LM user
would (``--recompute-granularity full``). ``docs/planner.md`` describes it with its
sources.

The baseline is the best such layout (every allowed TP, DP and backbone pipeline depth,
both placements, with and without recomputation), so speedups over it are not against a
straw man.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from dtdsl.cost.model import CostModel, build_cost_model
from dtdsl.ir.plan import Plan, UnitPlan, split_layers
from dtdsl.planner.evaluate import Evaluator
from dtdsl.planner.result import Layout, make_plan, no_layout_fits
from dtdsl.planner.space import Space, efficient_pps

__all__ = ["PLACEMENTS", "plan_baseline", "with_recompute"]

Progress = Callable[[int, int, str], None]


def with_recompute(cost: CostModel) -> CostModel | None:
    """``cost`` with every module recomputing its layers' activations in backward; None
    when the spec already recomputes everywhere."""
    program = cost.program
    if all(m.recompute for m in program.modules):
        return None
    modules = tuple(m.model_copy(update={"recompute": True}) for m in program.modules)
    return build_cost_model(program.model_copy(update={"modules": modules}), cost.params,
                            profile=cost.profile)


@dataclass(frozen=True)
class _Colocated:
    """A co-located layout's figures (arrays over the backbone's pipeline depths)."""

    time: np.ndarray
    warmup: np.ndarray
    steady: np.ndarray
    sync: np.ndarray
    feasible: np.ndarray
    first_memory: np.ndarray      # the backbone's first stage, co-located encoders included
    unit_memory: tuple            # per unit: its own part of its stage's memory


def _colocated(ev: Evaluator, tp: int, dp: int, pps: np.ndarray) -> _Colocated:
    """Encoders on the backbone's first stage, generators on its last, all split by the
    backbone's ``tp``: a pipeline of the backbone's stages where the first (last) also
    runs the encoders (generators) of each microbatch. 1F1B over uneven stages takes the
    sum of the stages for the first microbatch and the slowest stage for every other."""
    cost = ev.cost
    n, b = len(ev.units), ev.backbone
    m = ev.microbatches(dp)
    pps = np.asarray(pps)
    est = ev.evaluate((tp,) * n, (dp,) * n, [pps if i == b else np.ones_like(pps)
                                             for i in range(n)], chained=True)
    enc = [i for i in range(n) if ev.roles[i] == "encoder"]
    gen = [i for i in range(n) if ev.roles[i] == "generator"]
    # With one stage and no hops, a unit's stage time is its whole microbatch.
    e = sum((np.asarray(est.stage_time_s[i]) for i in enc), np.zeros(()))
    g = sum((np.asarray(est.stage_time_s[i]) for i in gen), np.zeros(()))
    t_b = np.asarray(est.stage_time_s[b])
    # The backbone's own warm-up: what the chained evaluation adds on top of the one-stage
    # units and the transfers between units, which co-location removes.
    warm_b = np.asarray(est.warmup_s) - e - g - ev.edge_s
    single = pps == 1
    slowest = np.where(single, t_b + e + g, t_b + np.maximum(e, g))
    warmup = warm_b + e + g
    steady = slowest * (m - 1)
    unit = ev.units
    sync_b = cost.dp_sync_time_s(unit[b], tp, pps, dp)
    sync_e = sum((cost.dp_sync_time_s(unit[i], tp, 1, dp) for i in enc), 0.0)
    sync_g = sum((cost.dp_sync_time_s(unit[i], tp, 1, dp) for i in gen), 0.0)
    sync = np.where(single, sync_b + sync_e + sync_g, sync_b + np.maximum(sync_e, sync_g))

    # Memory: the encoders' activations stay as long as the first stage's microbatches
    # (pp of them in 1F1B), the generators' one microbatch on the last stage.
    vpp = ev.vpp(b, pps, m)
    first_b = cost.memory_bytes(unit[b], tp, pps, dp, vpp, pps, m, 1.0)
    own = {i: cost.memory_bytes(unit[i], tp, 1, dp, 1, pps, m, 1.0) for i in enc}
    own.update({i: cost.memory_bytes(unit[i], tp, 1, dp, 1, 1, m, 1.0) for i in gen})
    last_b = np.asarray([
        cost.stage_memory_bytes(unit[b], tp=tp, pp=int(p), dp=dp, vpp=int(v), stage=int(p) - 1,
                                layers=split_layers(unit[b].layers, int(p))[-1], depth=1,
                                microbatches=m, share=1.0)
        for p, v in zip(pps.ravel(), np.broadcast_to(vpp, pps.shape).ravel(), strict=True)
    ]).reshape(pps.shape)
    on_first = first_b + sum((own[i] for i in enc), 0.0) + \
        np.where(single, sum((own[i] for i in gen), 0.0), 0.0)
    on_last = last_b + sum((own[i] for i in gen), 0.0)
    # A stage's GPUs must hold every unit on them within each unit's own limit.
    limit_first = min(ev.memory_limit[i] for i in [b, *enc])
    limit_last = min(ev.memory_limit[i] for i in [b, *gen])
    feasible = (tp * dp * pps <= ev.num_gpus) & (on_first <= limit_first) & \
        np.where(single, on_first <= limit_last, on_last <= limit_last)
    unit_memory = tuple(on_first if i == b else own.get(i) for i in range(n))
    return _Colocated(time=warmup + steady + sync, warmup=warmup, steady=steady, sync=sync,
                      feasible=feasible, first_memory=on_first, unit_memory=unit_memory)


PLACEMENTS = ("stages", "colocated")


def plan_baseline(cost: CostModel, num_gpus: int | None = None, *,
                  progress: Progress | None = None,
                  placements: tuple[str, ...] = PLACEMENTS, recompute: bool = True) -> Plan:
    """The best rigid Megatron-LM layout on ``num_gpus`` GPUs: encoders and generators
    on stages of their own or co-located (``placements``, both by default), recomputing
    every layer where nothing fits without (unless ``recompute`` is off)."""
    start = time.perf_counter()
    num_gpus = num_gpus or cost.program.cluster.num_gpus
    if not placements or set(placements) - set(PLACEMENTS):
        raise ValueError(f"placements must be some of {PLACEMENTS}, not {placements!r}")
    # With recomputation every layout is slower than without: a layout it wins with is
    # one that does not fit without it.
    variants = [cost]
    recomputing = with_recompute(cost) if recompute else None
    if recomputing is not None:
        variants.append(recomputing)
    best: tuple[float, Evaluator, Layout, bool] | None = None
    evaluated = candidates = 0
    space = None
    steps = 0
    for cost_v in variants:
        ev = Evaluator(cost_v, num_gpus)
        space = Space(ev)
        b = space.backbone
        n = space.n
        replicated = tuple(i != b for i in range(n))
        pps_b = np.asarray(efficient_pps(space.units[b].layers, space.pps(b)))
        # Own stages: the backbone's pipeline is split as it fits best, every other unit
        # is one stage of its own.
        choices = [pps_b if i == b else np.asarray([p for p in space.pps(i) if p == 1])
                   for i in range(n)]
        own_ok = "stages" in placements and all(c.size for c in choices)
        grids = np.meshgrid(*choices, indexing="ij", sparse=True) if own_ok else None
        stages = sum(grids) if own_ok else None
        tps, dp_lms = space.tps(b), space.dp_lms()
        total_steps = len(tps) * len(variants)
        for tp in tps:
            if progress is not None:
                progress(steps, total_steps, f"tp {tp}")
            steps += 1
            for dp in dp_lms:
                if tp * dp > num_gpus:
                    continue
                candidates += 1
                if own_ok:
                    est = ev.evaluate((tp,) * n, (dp,) * n, grids, replicated=replicated,
                                      chained=True)
                    ok = np.asarray(est.feasible) & (tp * dp * stages <= num_gpus)
                    evaluated += int(ok.size)
                    if ok.any():
                        times = np.where(ok, est.iteration_time_s, np.inf)
                        i = np.unravel_index(np.argmin(times), times.shape)
                        if best is None or times[i] < best[0]:
                            layout = Layout(tp=(tp,) * n, dp=(dp,) * n,
                                            pp=tuple(int(c[j]) for c, j in
                                                     zip(choices, i, strict=True)),
                                            iteration_time_s=float(times[i]),
                                            replicated=replicated, chained=True)
                            best = (float(times[i]), ev, layout, False)
                if "colocated" in placements and pps_b.size:
                    co = _colocated(ev, tp, dp, pps_b)
                    evaluated += int(pps_b.size)
                    if co.feasible.any():
                        times = np.where(co.feasible, co.time, np.inf)
                        k = int(np.argmin(times))
                        if best is None or times[k] < best[0]:
                            layout = Layout(tp=(tp,) * n, dp=(dp,) * n,
                                            pp=tuple(int(pps_b[k]) if i == b else 1
                                                     for i in range(n)),
                                            iteration_time_s=float(times[k]), chained=True)
                            best = (float(times[k]), ev, layout, True)
    if progress is not None:
        progress(steps, steps, "done")
    if best is None:
        assert space is not None
        raise no_layout_fits(Space(Evaluator(cost, num_gpus)))
    _, ev, layout, colocated = best
    solve = time.perf_counter() - start
    if colocated:
        return _colocated_plan(ev, layout, solve_time_s=solve, candidates=candidates,
                               evaluated=evaluated)
    return make_plan(ev, "baseline", layout, solve_time_s=solve, candidates=candidates,
                     convex_solves=0, evaluated=evaluated,
                     baseline_iteration_time_s=layout.iteration_time_s)


def _colocated_plan(ev: Evaluator, layout: Layout, *, solve_time_s: float, candidates: int,
                    evaluated: int) -> Plan:
    """The Plan of a co-located layout: the backbone's ranks only; the encoders (first
    stage) and generators (last stage) are listed on those GPUs with ``gpus`` 0."""
    program = ev.cost.program
    b = ev.backbone
    tp, dp, pp = layout.tp[b], layout.dp[b], layout.pp[b]
    co = _colocated(ev, tp, dp, np.asarray([pp]))
    iteration = float(co.time[0])
    assert bool(co.feasible[0]), "planners return feasible layouts"
    assert math.isclose(iteration, layout.iteration_time_s, rel_tol=1e-9)
    m = ev.microbatches(dp)
    backbone_first = 0      # the encoders before it hold no GPU
    units = []
    for i, unit in enumerate(ev.units):
        own = i == b
        fwd, bwd = ev.fwd_bwd(i, tp)
        upp = pp if own else 1
        heaviest = math.ceil(unit.layers / upp) / unit.layers
        if unit.role == "encoder":
            projectors = tuple(p.name for p in program.projectors if p.source == unit.name)
            first_rank = backbone_first
        elif unit.role == "generator":
            projectors = tuple(p.name for p in program.projectors if p.target == unit.name)
            first_rank = backbone_first + (pp - 1) * tp * dp
        else:
            projectors = ()
            first_rank = backbone_first
        units.append(UnitPlan(
            name=unit.name, role=unit.role, projectors=projectors,
            gpus=tp * dp * pp if own else 0, tp=tp, dp=dp, pp=upp,
            vpp=int(np.asarray(ev.vpp(i, upp, m))), colocated=not own,
            recompute=program.module(unit.name).recompute, first_rank=first_rank,
            layers_per_stage=split_layers(unit.layers, upp), microbatch_share=1.0,
            fwd_time_s=fwd * heaviest, bwd_time_s=bwd * heaviest,
            dp_sync_time_s=float(ev.cost.dp_sync_time_s(unit, tp, upp, dp)),
            memory_bytes=float(np.broadcast_to(co.unit_memory[i], (1,))[0]),
            memory_limit_bytes=ev.memory_limit[i]))
    train = program.train
    return Plan(
        spec=program.name, spec_sha256=program.source_sha256, search="baseline",
        num_gpus=ev.num_gpus, gpus_used=tp * dp * pp, global_batch=train.global_batch,
        micro_batch=train.micro_batch, num_microbatches=m, schedule=train.schedule,
        iteration_time_s=iteration, warmup_time_s=float(co.warmup[0]),
        steady_time_s=float(co.steady[0]), dp_sync_time_s=float(co.sync[0]),
        model_flops_per_iteration=ev.model_flops_per_iteration, mfu=ev.mfu(iteration),
        mfu_full_attention=ev.mfu(iteration, full_attention=True),
        solve_time_s=solve_time_s, candidates=candidates, convex_solves=0,
        evaluated=evaluated, baseline_iteration_time_s=iteration, units=tuple(units))
