"""The convex planner against the exhaustive optimum, at cluster sizes up to 128 GPUs,
on the shipped specs and on randomly generated ones.

Target: the convex plan's iteration time within 0.5% of the exhaustive optimum
everywhere (the branch and bound prunes within 0.1%).

    python benchmarks/convex_vs_exhaustive.py                    # sampled sizes
    python benchmarks/convex_vs_exhaustive.py --sizes all        # every size 1..128 (hours)
    python benchmarks/convex_vs_exhaustive.py --random 50 --seed 7
"""

from __future__ import annotations

import argparse
import random
import time

from _common import SHIPPED, compile_text, cost

from dtdsl.cost.model import build_cost_model
from dtdsl.planner import Infeasible, plan_convex, plan_exhaustive
from tests.planner.random_specs import random_spec

TARGET = 0.005


def compare(model, gpus: int) -> tuple[float | None, float, float]:
    """(relative gap or None if nothing fits, convex seconds, exhaustive seconds)."""
    start = time.perf_counter()
    try:
        exact = plan_exhaustive(model, gpus)
    except Infeasible:
        exact = None
    t_exact = time.perf_counter() - start
    start = time.perf_counter()
    try:
        convex = plan_convex(model, gpus)
    except Infeasible:
        convex = None
    t_convex = time.perf_counter() - start
    if (exact is None) != (convex is None):
        raise SystemExit(f"the searches disagree on feasibility at {gpus} GPUs")
    if exact is None:
        return None, t_convex, t_exact
    return convex.iteration_time_s / exact.iteration_time_s - 1, t_convex, t_exact


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--specs", nargs="*", default=list(SHIPPED))
    parser.add_argument("--sizes", default="sample",
                        help="'sample' (8 random sizes per spec plus 128), 'all', or a "
                        "comma-separated list")
    parser.add_argument("--random", type=int, default=20, help="random specs to try")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    gaps: list[float] = []
    print(f"{'spec':<14} {'GPUs':>5} {'gap':>10} {'convex':>9} {'exhaustive':>11}")

    def report(label: str, model, gpus: int) -> None:
        gap, tc, te = compare(model, gpus)
        shown = "infeasible" if gap is None else f"{gap:+.4%}"
        print(f"{label:<14} {gpus:>5} {shown:>10} {tc:>8.2f}s {te:>10.2f}s", flush=True)
        if gap is not None:
            gaps.append(gap)

    for name in args.specs:
        if args.sizes == "all":
            sizes = list(range(1, 129))
        elif args.sizes == "sample":
            sizes = sorted(rng.sample(range(2, 128), 8)) + [128]
        else:
            sizes = [int(s) for s in args.sizes.split(",")]
        for gpus in sizes:
            report(name, cost(name), gpus)
    for k in range(args.random):
        spec_rng = random.Random(args.seed * 100_003 + k)
        model = build_cost_model(compile_text(f"random{k}", random_spec(
            spec_rng, f"random{k}", max_units=4)))
        report(f"random{k}", model, spec_rng.randint(4, 64))
    worst = max(gaps) if gaps else 0.0
    print(f"\n{len(gaps)} feasible cases: worst gap {worst:+.4%}, mean "
          f"{sum(gaps) / max(len(gaps), 1):+.4%}; "
          f"{'all within' if worst <= TARGET else 'NOT all within'} {TARGET:.1%}")


if __name__ == "__main__":
    main()
