"""Where the time of an iteration goes, for dtc plan's plan and both Megatron-LM baselines
on the same drawn batches: the simulator run on the routed batches with parts of their
variation taken away, one at a time.

    compute   the slowest unit stage's compute at mean work (steps x its stage time):
              what no schedule can hide
    bubbles   warm-up, cool-down, gradient sync and transfers at mean work: the simulated
              iteration at mean work less ``compute``
    variation what consecutive microbatches of different work cost: every replica of a
              step given the step's mean work, less the mean-work run
    imbalance what a step's slowest replica costs: the routed batch less the balanced one
    comm      the routed batch less the same with every transfer free (overlaps the rest)

and the share of the GPUs that do not hold the backbone (idle for much of each step in a
disaggregated plan: an encoder or generator sized to whole TP groups). Times per step
are per position (a packed step's over an unpacked one's positions), so rows compare.

    python benchmarks/where_time_goes.py [--steps 2] [SPEC ...]
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from statistics import fmean

import numpy as np
from _common import SHIPPED, UNSHIPPED
from mfu_speedup import plan_as_a_user

from dtdsl.ir.plan import BASELINES
from dtdsl.planner.simulated import SpecData
from dtdsl.reorder.workload import route
from dtdsl.schedule.lower import lower
from dtdsl.sim.simulate import Simulator
from dtdsl.sim.workload import iteration_durations

PARTS = ("compute", "bubbles", "variation", "imbalance")


def _balanced(durations):
    """Every replica of a step at the step's mean over the replicas."""
    return replace(durations, compute_s={
        u: np.broadcast_to(a.mean(axis=-1, keepdims=True), a.shape).copy()
        for u, a in durations.compute_s.items()})


def _mean(durations):
    """Every step and replica at the mean over both."""
    return replace(durations, compute_s={
        u: np.broadcast_to(a.mean(axis=(-2, -1), keepdims=True), a.shape).copy()
        for u, a in durations.compute_s.items()})


def _free_links(durations):
    return replace(durations, link_s={k: 0.0 for k in durations.link_s})


def decompose(cost, plan, batches, policy) -> dict[str, float]:
    """Mean seconds per step of each part over ``batches``, and the simulated total."""
    schedule = lower(plan, cost.program)
    simulator = Simulator(schedule)
    parts = {k: [] for k in (*PARTS, "comm", "total")}
    for samples in batches.samples:
        work = batches.work_model.relative(samples)
        routing = route(plan, work, policy)
        durations = iteration_durations(plan, cost, schedule, routing, work)
        total = simulator.run(durations).iteration_time_s
        balanced = simulator.run(_balanced(durations)).iteration_time_s
        mean_run = simulator.run(_mean(durations))
        at_mean = mean_run.iteration_time_s
        # The slowest stage's compute at mean work: its busy seconds in the mean-work run.
        compute = max(mean_run.busy_s().values())
        parts["compute"].append(compute)
        parts["bubbles"].append(at_mean - compute)
        parts["variation"].append(balanced - at_mean)
        parts["imbalance"].append(total - balanced)
        parts["comm"].append(total - simulator.run(_free_links(durations)).iteration_time_s)
        parts["total"].append(total)
    return {k: fmean(v) for k, v in parts.items()}


def off_backbone(plan) -> float:
    """The share of the plan's GPUs that do not hold backbone stages."""
    used = sum(u.gpus for u in plan.units)
    backbone = sum(u.gpus for u in plan.units if u.role == "backbone")
    return 1.0 - backbone / used if used else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="drawn batches simulated")
    parser.add_argument("specs", nargs="*", default=list(SHIPPED + UNSHIPPED))
    args = parser.parse_args()
    print(f"{'spec':<14} {'plan':<16} {'per k pos':>10} " +
          " ".join(f"{k:>10}" for k in (*PARTS, "comm")) + f" {'off llm':>8}")
    for name in args.specs:
        best, packs, _ = plan_as_a_user(name, args.steps)
        model = cost_of(name)
        data = SpecData(model, args.steps)
        ours_batches = data.batches(packs)
        rows = [("ours" + (" (packed)" if packs else ""), data.cost(packs), best.model_copy(
            update={"simulated": None, "baselines": None}), ours_batches,
            frozenset(model.program.train.reorder))]
        for base_name in BASELINES:
            base = (best.baselines or {}).get(base_name)
            if base is None:
                continue
            base_cost = data.cost(base.packing)
            # The layout's own cost model prices it (padding, recomputation): rebuild it
            # as the baseline search did.
            from dtdsl.planner.baseline import baseline_cost, with_recompute
            priced = baseline_cost(base_cost, pad_to_seq_len=any(
                u.padding == "seq_len" for u in base.layout.units))
            if any(u.recompute for u in base.layout.units) and \
                    not all(m.recompute for m in priced.program.modules):
                priced = with_recompute(priced) or priced
            rows.append((base_name, priced, base.layout, data.batches(base.packing),
                         frozenset()))
        for label, c, p, batches, policy in rows:
            parts = decompose(c, p, batches, policy)
            per_k = 1000.0 / batches.positions
            print(f"{name:<14} {label:<16} {parts['total'] * per_k * 1e3:>8.3f}ms " +
                  " ".join(f"{parts[k] * per_k * 1e3:>8.3f}ms" for k in (*PARTS, "comm")) +
                  f" {off_backbone(p):>8.1%}", flush=True)
    print("\nms per 1k positions; compute + bubbles + variation + imbalance = the total; "
          "comm overlaps them; off llm: GPUs not on the backbone")


def cost_of(name: str):
    from _common import cost

    return cost(name)


if __name__ == "__main__":
    main()
