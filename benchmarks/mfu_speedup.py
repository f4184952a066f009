"""The planner against Megatron-LM, per shipped spec: planned (mean work) and simulated
(drawn batches, with and without the spec's reordering) iteration times of dtc plan's
plan (the convex search's, or a runner-up faster on the drawn batches) and of the
faithful Megatron-LM baseline (``planner.baseline``: encoders and generators on one
stage of their own or co-located with the backbone's first and last stages, recompute
where nothing fits without), MFU in both conventions, and the speedups.

The paper measured 54.7% MFU (paper-era count) for the 72B model on 1172 GPUs and up
to 2.2x Megatron-LM's throughput; a predicted MFU above 60% would mean the cost model is
wrong.

    python benchmarks/mfu_speedup.py [--steps 4] [SPEC ...]
"""

from __future__ import annotations

import argparse

from _common import SHIPPED, cost

from dtdsl.planner import Infeasible, plan, plan_baseline


def layout(plan) -> str:
    return "  ".join(f"{u.name}:{u.gpus}g tp{u.tp} dp{u.dp} pp{u.pp}"
                     + (" co-located" if u.colocated else "")
                     + (" recompute" if u.recompute else "") for u in plan.units)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="drawn batches simulated")
    parser.add_argument("specs", nargs="*", default=list(SHIPPED))
    args = parser.parse_args()
    head = (f"{'spec':<12} {'GPUs':>5} {'planned':>9} {'sim':>9} {'sim none':>9} "
            f"{'base plan':>9} {'base sim':>9} {'MFU':>6} {'MFU pe':>6} "
            f"{'x plan':>6} {'x sim':>6} {'x none':>6}")
    print(head)
    for name in args.specs:
        model = cost(name)
        gpus = model.program.cluster.num_gpus
        # dtc plan's choice: the convex plan or a runner-up, the fastest on drawn batches.
        best = plan(model, gpus, simulate_steps=args.steps)
        sim = best.simulated.iteration_time_s
        plain = best.simulated.no_reorder_iteration_time_s
        base_sim = best.simulated.baseline_iteration_time_s
        try:
            base = plan_baseline(model, gpus)
        except Infeasible:
            base = None

        def ratio(a: float | None, b: float) -> str:
            return f"{a / b:>5.2f}x" if a is not None else f"{'-':>6}"

        print(f"{name:<12} {gpus:>5} {best.iteration_time_s:>8.3f}s {sim:>8.3f}s "
              f"{plain:>8.3f}s "
              + (f"{base.iteration_time_s:>8.3f}s {base_sim:>8.3f}s " if base is not None
                 else f"{'-':>9} {'-':>9} ")
              + f"{best.mfu:>6.1%} {best.mfu_full_attention:>6.1%} "
              f"{ratio(base and base.iteration_time_s, best.iteration_time_s)} "
              f"{ratio(base_sim, sim)} {ratio(base_sim, plain)}")
        print(f"    dtdsl:    {layout(best)}")
        if base is not None:
            print(f"    baseline: {layout(base)}")
    print("\nplanned: the pipeline formula on mean work; sim: the simulator on drawn batches "
          "under the spec's reorder policy; sim none: without reordering; MFU pe: the "
          "paper-era count (causal attention whole); x: the baseline's time over dtdsl's")


if __name__ == "__main__":
    main()
