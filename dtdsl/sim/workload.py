"""A routed global batch's durations for the simulator (``iteration_durations``): per pass,
stage, chunk, step and replica, seconds: the plan's per-microbatch times scaled by the work
routed there (``reorder.workload``), transfers and gradient sync from the cost model. Under
the zero_bubble schedule, the weight gradients' share of each unit's own backward
(``CostModel.weight_grad_share``) is its ``W``'s; a co-located module's backward stays
whole in the host stage's ``B``."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from dtdsl.cost.model import CostModel
from dtdsl.ir.plan import Plan
from dtdsl.ir.schedule import Schedule
from dtdsl.reorder.workload import (
    Routing,
    _loads,
    _per_sample_seconds,
    _phase_steps,
    phase_fit,
)
from dtdsl.sim.simulate import Durations

__all__ = ["iteration_durations"]


def iteration_durations(plan: Plan, cost: CostModel, schedule: Schedule, routing: Routing,
                        work: dict[str, np.ndarray]) -> Durations:
    """Seconds of every pass, transfer and end of step (gradient sync and optimizer
    step, as SYNC: ``UnitPlan.dp_sync_time_s``) of one iteration."""
    seconds = _per_sample_seconds(plan)
    compute = {}
    weights = {}        # zero_bubble: the W's seconds of each backward (module docstring)
    links: dict[tuple[str, str], float] = {}
    sync = {}
    by_name = {u.name: u for u in plan.units}
    for su in schedule.units:
        u = by_name[su.name]
        loads = _loads(routing, u, work)                            # (M, dp)
        layers = np.asarray(u.layers_per_stage, dtype=float)
        stage_scale = layers / layers.max() / su.vpp                # (pp,)
        f, b = seconds[u.name]
        arr = np.empty((2, su.pp, su.vpp, routing.num_microbatches, su.dp))
        arr[0] = (f * stage_scale)[:, None, None, None] * loads[None, None]
        arr[1] = (b * stage_scale)[:, None, None, None] * loads[None, None]
        compute[u.name] = arr
        if schedule.name == "zero_bubble":
            # Before co-located passes join the stage's: their backwards stay whole (B).
            weights[u.name] = arr[1] * cost.weight_grad_share(cost.unit(u.name))
        # Priced at the plan's context parallelism: each CP rank sends its share.
        unit_cost = replace(cost.unit(u.name), cp=u.cp)
        hop = float(cost.hop_time_s(unit_cost, 1 if u.tp_replicated else u.tp,
                                    u.microbatch_share))
        links[(u.name, u.name)] = hop
        sync[u.name] = np.full(su.pp, u.dp_sync_time_s)
    # Between units: the encoder's (backbone's) output crosses to the backbone
    # (generators), and the gradients of the same size come back, between the replicas
    # whose samples cross (the broker's routes).
    backbone = next(u for u in plan.units if u.role == "backbone")
    routes = {}
    # Phased encoders: events of each backbone stage's row, in the pipeline's bubbles
    # where they fit (``phase_fit``; the simulator's ``Durations.bubbles``); their
    # gradient sync over the backbone's GPUs ends the first stage's step.
    bubbles = []
    steps = _phase_steps(plan, routing, work)
    if steps:
        owners = phase_fit(plan).owners
        for name, (f, b) in steps.items():
            compute[name] = np.stack([f, b])[:, None, None]       # (2, 1, 1, steps, dp)
            bubbles.append((name, owners))
    for u in plan.units:
        if u.phased:
            sync[backbone.name][0] += u.dp_sync_time_s
        elif u.colocated:
            # The baseline's co-located encoder (generator): its passes run on the
            # backbone's first (last) stage, on the same replica as the sample's backbone.
            loads = _loads(routing, u, work)
            f, b = seconds[u.name]
            at = 0 if u.role == "encoder" else backbone.pp - 1
            vpp_b = compute[backbone.name].shape[2]
            chunk = 0 if u.role == "encoder" else vpp_b - 1
            compute[backbone.name][0, at, chunk] += f * loads
            compute[backbone.name][1, at, chunk] += b * loads
            sync[backbone.name][at] += u.dp_sync_time_s
        elif u.role == "encoder":
            links[(u.name, backbone.name)] = links[(backbone.name, u.name)] = links[
                (u.name, u.name)]
            routes[(u.name, backbone.name)] = routing.pairs(u.name, u.dp, backbone.name,
                                                            backbone.dp)
        elif u.role == "generator":
            links[(backbone.name, u.name)] = links[(u.name, backbone.name)] = links[
                (backbone.name, backbone.name)]
            routes[(backbone.name, u.name)] = routing.pairs(backbone.name, backbone.dp,
                                                            u.name, u.dp)
    return Durations(compute_s=compute, link_s=links, sync_s=sync, routes=routes,
                     bubbles=tuple(bubbles), weight_s=weights)
