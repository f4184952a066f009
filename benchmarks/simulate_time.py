"""How fast the pipeline simulator runs: one unit of 32 stages x 256 microbatches under
1F1B (the issue's target: at most 10 ms per simulated iteration), interleaved and GPipe
of the same size, and the shipped specs' plans. Lowering and compiling a schedule happen
once per plan; running it happens once per simulated step, so that is the figure.

    python benchmarks/simulate_time.py [--repeats 7]
"""

from __future__ import annotations

import argparse

from _common import SHIPPED, cost, shipped, timed

from dtdsl.ir.schedule import Schedule, ScheduleUnit
from dtdsl.planner import plan
from dtdsl.reorder.workload import parse_policy
from dtdsl.schedule.lower import GradientFlow, lower, lower_units
from dtdsl.sim.run import simulate_steps
from dtdsl.sim.simulate import Durations, Simulator

TARGET_S = 0.010
STEPS = 3


def _synthetic(name: str, p: int, m: int, vpp: int = 1) -> tuple[str, Schedule]:
    u = ScheduleUnit(name="llm", role="backbone", tp=1, dp=1, pp=p, vpp=vpp)
    base = Schedule.skeleton(name, m, (u,))
    return f"{name} {p}x{m}" + (f" v{vpp}" if vpp > 1 else ""), lower_units(
        base, GradientFlow.everywhere(base))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(f"{'schedule':<24} {'actions':>8} {'nodes':>7} {'lower':>8} {'compile':>8} "
          f"{'run':>8} {'run/target':>10}")
    cases = [("1f1b", 32, 256, 1), ("interleaved", 32, 256, 2), ("gpipe", 32, 256, 1)]
    for name, p, m, v in cases:
        (label, schedule), t_lower, _ = timed(lambda n=name, p=p, m=m, v=v:
                                              _synthetic(n, p, m, v), 1)
        sim, t_compile, _ = timed(lambda s=schedule: Simulator(s), 1)
        d = Durations.uniform(schedule, 1.0, 2.0)
        _, t_run, _ = timed(lambda s=sim, d=d: s.run(d), args.repeats)
        print(f"{label:<24} {schedule.num_actions:>8,} {sim.num_nodes:>7,} "
              f"{t_lower * 1e3:>6.0f}ms {t_compile * 1e3:>6.0f}ms {t_run * 1e3:>6.2f}ms "
              f"{t_run / TARGET_S:>10.2f}")
    print()
    print(f"{'spec':<14} {'actions':>8} {'lower':>8} {'step (draw, route, run)':>24}")
    for name in SHIPPED:
        program, model = shipped(name), cost(name)
        the_plan = plan(model, program.cluster.num_gpus, compare_baseline=False)
        schedule, t_lower, _ = timed(lambda p=the_plan, g=program: lower(p, g), 1)

        _, t_steps, _ = timed(lambda g=program, c=model, p=the_plan, s=schedule: list(
            simulate_steps(g, c, p, s, steps=STEPS, policy=parse_policy("none"))), 1)
        print(f"{name:<14} {schedule.num_actions:>8,} {t_lower * 1e3:>6.0f}ms "
              f"{t_steps / STEPS * 1e3:>22.1f}ms")


if __name__ == "__main__":
    main()
