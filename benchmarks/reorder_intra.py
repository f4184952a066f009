"""How close intra-microbatch reordering gets to the lower bound on skewed per-sample costs,
against DistTrain's greedy measured in the same run, and how long it takes.

Targets: max group load / lower bound at most 1.002 on average and 1.01 at worst, for 64 to
2048 samples over 8 to 64 groups; 2048 samples over 64 groups in at most 50 ms on a 2-core
machine (single process).

    python benchmarks/reorder_intra.py [--seeds 10] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics

from _common import timed

from dtdsl.reorder.intra import balance, greedy_lpt, group_loads, lower_bound
from tests.reorder.costs import KINDS, draw  # the costs the tests draw

SIZES = (64, 256, 1024, 2048)
GROUPS = (8, 16, 32, 64)
MEAN_TARGET, WORST_TARGET, TIME_TARGET_S = 1.002, 1.01, 0.050




def ratio(costs: list[float], assignment: list[int], groups: int) -> float:
    bound = lower_bound(costs, groups)
    return max(group_loads(costs, assignment, groups)) / bound if bound > 0 else 1.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    print(f"max group load / lower bound over {args.seeds} seeds")
    print(f"{'costs':<14} {'n':>5} {'G':>3} {'greedy mean':>12} {'worst':>8} "
          f"{'ours mean':>10} {'worst':>8} {'worst gain':>11}")
    means, worsts = [], []
    for kind in KINDS:
        for n in SIZES:
            for groups in GROUPS:
                if groups > n // 2:
                    continue
                ours, greedy = [], []
                for seed in range(args.seeds):
                    costs = draw(kind, n, seed)
                    ours.append(ratio(costs, balance(costs, groups), groups))
                    greedy.append(ratio(costs, greedy_lpt(costs, groups), groups))
                means.append(statistics.fmean(ours))
                worsts.append(max(ours))
                print(f"{kind:<14} {n:>5} {groups:>3} {statistics.fmean(greedy):>12.6f} "
                      f"{max(greedy):>8.5f} {means[-1]:>10.6f} {worsts[-1]:>8.5f} "
                      f"{max(greedy) / worsts[-1]:>10.4f}x")
    for name, value, target in (("mean", max(means), MEAN_TARGET),
                                ("worst", max(worsts), WORST_TARGET)):
        verdict = "meets" if value <= target else "MISSES"
        print(f"  -> {verdict} the {name} target {target} (highest cell: {value:.6f})")

    print(f"\ntime per call, 2048 samples over 64 groups (median and best of {args.repeats})")
    print(f"{'costs':<14} {'greedy':>9} {'ours':>9} {'best':>9} {'ours/greedy':>12}")
    slowest = 0.0
    for kind in KINDS:
        costs = draw(kind, 2048, seed=0)
        _, greedy_s, _ = timed(lambda c=costs: greedy_lpt(c, 64), args.repeats)
        _, ours_s, best_s = timed(lambda c=costs: balance(c, 64), args.repeats)
        slowest = max(slowest, ours_s)
        print(f"{kind:<14} {greedy_s * 1e3:>7.1f}ms {ours_s * 1e3:>7.1f}ms {best_s * 1e3:>7.1f}ms "
              f"{ours_s / greedy_s:>11.1f}x")
    verdict = "meets" if slowest <= TIME_TARGET_S else "MISSES"
    print(f"  -> {verdict} the 50 ms target ({slowest / TIME_TARGET_S:.2f} of it)")


if __name__ == "__main__":
    main()
