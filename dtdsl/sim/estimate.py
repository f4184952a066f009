"""A layout's iteration on a batch of real samples, estimated in milliseconds: the
planner's drawn-batch objective.

The pipeline formula (``planner.evaluate``) prices mean work. On real batches three
things move the time away from it, and each depends on the layout: consecutive
microbatches of different work leave 1F1B's stages waiting (more so the deeper the
pipeline and the more microbatches), a step's replicas wait for the one with the most
work, and a unit whose mean stage time is close to the backbone's becomes the slowest
on the steps where its samples are heavy. Reordering (``train.reorder``) removes part of
it, and can even beat the formula: its orders put small microbatches into the warm-up
and the cool-down.

``drawn_estimate`` plays the chain model of ``reorder.pipeline`` (every stage's forward
and backward per microbatch step, plain 1F1B, no communication) on the batch as
``route`` routes it (its quick form: the best grouping and candidate order, no local
search), and subtracts the same chain with every stage at its mean over the steps: the
seconds the batch's variation adds (or saves). Added to the formula's time, it ranks
layouts as the simulator does (Spearman 0.94 to 0.99 over the layouts near the optimum
of the shipped specs, the simulator's fastest ranked first; ``docs/planner.md``) for a
few chain passes rather than a simulation.

A rigid plan (a Megatron-LM baseline) runs its replicas as independent pipelines that
meet at the gradient sync: each replica's own chain, the slowest one counts.
"""

from __future__ import annotations

import numpy as np

from dtdsl.ir.plan import Plan
from dtdsl.reorder.workload import (
    _loads,
    _per_sample_seconds,
    phase_fit,
    phase_times,
    pipeline_times,
    route,
)

__all__ = ["drawn_estimate", "variation_s"]


def drawn_estimate(plan: Plan, work: dict[str, np.ndarray], policy: frozenset[str]) -> float:
    """The estimated iteration time of ``plan`` on the batch whose per-sample relative
    work is ``work`` (``reorder.workload.WorkModel.relative``), routed under ``policy``: the
    formula's time plus ``variation_s``."""
    return plan.iteration_time_s + variation_s(plan, work, policy)


def variation_s(plan: Plan, work: dict[str, np.ndarray], policy: frozenset[str]) -> float:
    """Seconds the batch's variation adds to ``plan``'s mean-work iteration (negative where
    its reordering saves more than the variation costs): the 1F1B chain on the routed
    batch less the chain at every stage's mean."""
    from dtdsl.reorder.pipeline import chain_columns

    routing = route(plan, work, policy, search=False)
    if plan.rigid:
        fwd, bwd = _replica_times(plan, routing, work)            # (stages, steps, dp)
    else:
        f, b = pipeline_times(plan, routing, work)                # (stages, steps)
        fwd, bwd = f[:, :, None], b[:, :, None]
    # The batch's pipelines and, in the last column, every stage at its mean: one pass.
    steps = fwd.shape[1]
    mean_f = np.repeat(fwd.mean(axis=(1, 2))[:, None, None], steps, axis=1)
    mean_b = np.repeat(bwd.mean(axis=(1, 2))[:, None, None], steps, axis=1)
    times = chain_columns(np.concatenate([fwd, mean_f], axis=2),
                          np.concatenate([bwd, mean_b], axis=2))
    return float(times[:-1].max() - times[-1]) + _phase_variation_s(plan, routing, work)


def _phase_variation_s(plan: Plan, routing, work: dict[str, np.ndarray]) -> float:
    """Seconds the batch adds to what the phased encoders expose (``phase_times``: the
    part of their work outside the pipeline's bubbles) over the plan's mean-work figure
    (``phase_fit``)."""
    if not any(u.phased for u in plan.units):
        return 0.0
    fit = phase_fit(plan)
    f, b = phase_times(plan, routing, work)
    return float((f + b).max() - (fit.exposed_f + fit.exposed_b))


def _replica_times(plan: Plan, routing, work: dict[str, np.ndarray]
                   ) -> tuple[np.ndarray, np.ndarray]:
    """(stages, steps, replicas) forward and backward seconds of a rigid plan's pipelines:
    its own-stage encoders one after another, the backbone's stages (a co-located encoder
    on the first, a co-located generator on the last), its own-stage generators."""
    seconds = _per_sample_seconds(plan)

    def stages(u) -> tuple[np.ndarray, np.ndarray]:
        load = _loads(routing, u, work)                               # (steps, dp)
        layers = np.asarray(u.layers_per_stage, dtype=float)
        scale = (layers / layers.max())[:, None, None]
        f, b = seconds[u.name]
        return f * scale * load[None], b * scale * load[None]

    backbone = next(u for u in plan.units if u.role == "backbone")
    fwd, bwd = stages(backbone)
    before_f, before_b, after_f, after_b = [], [], [], []
    for u in plan.units:
        if u is backbone or u.phased:
            continue
        f, b = stages(u)
        if u.colocated:
            at = 0 if u.role == "encoder" else -1
            fwd[at] += f[0]
            bwd[at] += b[0]
        elif u.role == "encoder":
            before_f.append(f)
            before_b.append(b)
        else:
            after_f.append(f)
            after_b.append(b)
    return (np.concatenate([*before_f, fwd, *after_f]),
            np.concatenate([*before_b, bwd, *after_b]))
