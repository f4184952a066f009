"""The baseline: Megatron-LM's rigid orchestration, what users run today.

One TP degree and one DP degree for the whole model. The encoders and generators
become extra pipeline stages of the backbone's pipeline, before and after it,
ONE stage each, as Megatron-LM's multimodal training does it (its LLaVA model
provider, ``examples/multimodal/model.py``, asserts
``encoder_pipeline_model_parallel_size <= 1``: "LLaVA does not support pp>1 for
encoder on it's own pipeline rank"). A pipeline stage spans one TP group, so each
of those stages is replicated across the TP group's GPUs: every rank computes the
whole encoder (or generator) stage, so TP buys them nothing. Every unit has the
backbone's DP and microbatch, and the pipeline is one chain, encoders one after
another. ``docs/planner.md`` describes it with its source.

The baseline is the best such layout (every allowed TP, DP and backbone pipeline
split), so speedups over it are not against a straw man.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from dtdsl.cost.model import CostModel
from dtdsl.ir.plan import Plan
from dtdsl.planner.evaluate import Evaluator
from dtdsl.planner.result import Layout, make_plan, no_layout_fits
from dtdsl.planner.space import Space, efficient_pps

__all__ = ["plan_baseline"]

Progress = Callable[[int, int, str], None]


def plan_baseline(cost: CostModel, num_gpus: int | None = None, *,
                  progress: Progress | None = None) -> Plan:
    """The best rigid Megatron-LM layout on ``num_gpus`` GPUs."""
    start = time.perf_counter()
    num_gpus = num_gpus or cost.program.cluster.num_gpus
    ev = Evaluator(cost, num_gpus)
    space = Space(ev)
    b = space.backbone
    replicated = tuple(i != b for i in range(space.n))
    # The backbone's pipeline is split as it fits best; every other unit is one stage.
    choices = [np.asarray(efficient_pps(u.layers, space.pps(i)) if i == b else
                          [p for p in space.pps(i) if p == 1])
               for i, u in enumerate(space.units)]
    if any(c.size == 0 for c in choices):
        raise no_layout_fits(space)
    grids = np.meshgrid(*choices, indexing="ij", sparse=True)
    stages = sum(grids)
    tps, dp_lms = space.tps(b), space.dp_lms()
    best: Layout | None = None
    evaluated = candidates = 0
    for k, tp in enumerate(tps):
        if progress is not None:
            progress(k, len(tps), f"tp {tp}")
        for dp in dp_lms:
            if tp * dp > num_gpus:
                continue
            candidates += 1
            est = ev.evaluate((tp,) * space.n, (dp,) * space.n, grids, replicated=replicated,
                              chained=True)
            ok = np.asarray(est.feasible) & (tp * dp * stages <= num_gpus)
            evaluated += int(ok.size)
            if not ok.any():
                continue
            times = np.where(ok, est.iteration_time_s, np.inf)
            i = np.unravel_index(np.argmin(times), times.shape)
            if best is None or times[i] < best.iteration_time_s:
                best = Layout(tp=(tp,) * space.n, dp=(dp,) * space.n,
                              pp=tuple(int(c[j]) for c, j in zip(choices, i, strict=True)),
                              iteration_time_s=float(times[i]), replicated=replicated,
                              chained=True)
    if progress is not None:
        progress(len(tps), len(tps), "done")
    if best is None:
        raise no_layout_fits(space)
    return make_plan(ev, "baseline", best, solve_time_s=time.perf_counter() - start,
                     candidates=candidates, convex_solves=0, evaluated=evaluated,
                     baseline_iteration_time_s=best.iteration_time_s)
