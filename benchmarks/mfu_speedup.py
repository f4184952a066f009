"""Predicted MFU of the convex plans and their speedup over the Megatron-LM baseline
(one TP/DP for the whole model, encoders and generators as extra pipeline stages
replicated over the TP group), on the shipped specs and a range of cluster sizes.

The paper measured 54.7% MFU for the 72B model on 1172 GPUs and up to 2.2x Megatron-LM's
throughput; a predicted MFU above 60% would mean the cost model is wrong.

    python benchmarks/mfu_speedup.py
"""

from __future__ import annotations

from _common import SHIPPED, cost, shipped

from dtdsl.planner import Infeasible, plan_baseline, plan_convex


def layout(plan) -> str:
    return "  ".join(f"{u.name}:{u.gpus}g tp{u.tp} dp{u.dp} pp{u.pp}" for u in plan.units)


def main() -> None:
    cases = [(name, shipped(name).cluster.num_gpus) for name in SHIPPED]
    cases += [("mllm_72b", n) for n in (256, 512, 2048)]
    cases += [("mllm_9b", n) for n in (32, 256)]
    print(f"{'spec':<12} {'GPUs':>5} {'MFU':>6} {'baseline MFU':>13} {'speedup':>8}")
    for name, gpus in cases:
        model = cost(name)
        best = plan_convex(model, gpus)
        try:
            base = plan_baseline(model, gpus)
        except Infeasible:
            print(f"{name:<12} {gpus:>5} {best.mfu:>6.1%} {'(none fits)':>13}")
            continue
        print(f"{name:<12} {gpus:>5} {best.mfu:>6.1%} {base.mfu:>13.1%} "
              f"{base.iteration_time_s / best.iteration_time_s:>7.2f}x")
        print(f"    dtdsl:    {layout(best)}")
        print(f"    baseline: {layout(base)}")


if __name__ == "__main__":
    main()
