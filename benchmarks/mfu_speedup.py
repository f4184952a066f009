"""The planner against Megatron-LM, per shipped spec: dtc plan's plan (the convex search's,
or a runner-up faster on the drawn batches) against both Megatron-LM baselines
(``planner.baseline``: ``megatron`` unpacked, padded to seq_len under pipeline
parallelism; ``megatron_packed`` packed into sequences of seq_len attending within their
documents), each chosen as the fastest of its layouts on the same drawn batches.

Per spec: our planned (mean work) and simulated (drawn batches, with and without the
spec's reordering) iteration times and MFU; each baseline's planned and simulated times
and the speedup of ours over it, planned and simulated (per position for the packed
baseline, whose steps hold more positions: ``Baseline.positions_ratio``); the layouts
below.

    python benchmarks/mfu_speedup.py [--steps 4] [SPEC ...]
"""

from __future__ import annotations

import argparse
import time

from _common import SHIPPED, cost

from dtdsl.ir.plan import BASELINES
from dtdsl.planner import plan
from dtdsl.report import baseline_layout


def ours_layout(p) -> str:
    return "  ".join(f"{u.name}:{u.gpus}g tp{u.tp} dp{u.dp} pp{u.pp}" for u in p.units)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="drawn batches simulated")
    parser.add_argument("specs", nargs="*", default=list(SHIPPED))
    args = parser.parse_args()
    head = (f"{'spec':<12} {'GPUs':>5} {'ours plan':>9} {'sim':>8} {'sim none':>8} "
            f"{'MFU':>6} | " + " | ".join(
                f"{name + ' plan':>20} {'sim':>8} {'x plan':>6} {'x sim':>6}"
                for name in BASELINES))
    print(head)
    details = []
    for name in args.specs:
        model = cost(name)
        gpus = model.program.cluster.num_gpus
        start = time.perf_counter()
        best = plan(model, gpus, simulate_steps=args.steps)
        took = time.perf_counter() - start
        sim = best.simulated
        row = (f"{name:<12} {gpus:>5} {best.iteration_time_s:>8.3f}s "
               f"{sim.iteration_time_s:>7.3f}s {sim.no_reorder_iteration_time_s:>7.3f}s "
               f"{best.mfu:>6.1%} | ")
        cells = []
        for base_name in BASELINES:
            base = (best.baselines or {}).get(base_name)
            if base is None:
                cells.append(f"{'-':>20} {'-':>8} {'-':>6} {'-':>6}")
                continue
            cells.append(f"{base.planned_s:>19.3f}s {base.simulated_s:>7.3f}s "
                         f"{base.speedup:>5.2f}x {base.simulated_speedup:>5.2f}x")
        print(row + " | ".join(cells))
        lines = [f"{name} ({took:.1f} s to plan)", f"    ours:            {ours_layout(best)}"]
        for base_name in BASELINES:
            base = (best.baselines or {}).get(base_name)
            if base is not None:
                ratio = f", {base.simulated_positions_ratio:.2f}x the positions a step" \
                    if base.simulated_positions_ratio != 1.0 else ""
                lines.append(f"    {base_name + ':':<16} {baseline_layout(base.layout)} "
                             f"(the fastest of {base.candidates} on the drawn batches{ratio})")
        details.append("\n".join(lines))
    print()
    print("\n".join(details))
    print("\nplan: the pipeline formula on mean work; sim: the simulator on the drawn "
          "batches (ours under the spec's reorder policy; sim none: without); x: ours "
          "over the baseline, per position (the baseline's time per position over ours)")


if __name__ == "__main__":
    main()
