"""How long the compiler's own steps take on this machine: lowering every shipped spec's
plan and a 32-stage x 256-microbatch 1F1B pipeline, drawing that pipeline's Gantt chart,
and `dtc compile` of the 72B spec (1172 ranks). The suite checks what they produce; the
times are here (a shared 2-core machine makes them noisy there).

Targets (2-core machine): each shipped spec lowers in under 2 s, the 32 x 256 pipeline in
under 5 s, its Gantt chart in under 3 s, the 72B bundle compiles in under 10 s.

    python benchmarks/tool_times.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from _common import ROOT, SHIPPED, cost, shipped, timed

from dtdsl import cli
from dtdsl.ir.schedule import Schedule, ScheduleUnit
from dtdsl.ir.timeline import Event, Timeline, TimelineUnit
from dtdsl.planner import plan
from dtdsl.schedule.lower import GradientFlow, lower, lower_units
from dtdsl.sim.gantt import render_gantt


def _big_timeline(pp: int = 32, m: int = 256) -> Timeline:
    unit = TimelineUnit(name="llm", role="backbone", pp=pp, dp=1, tp=1)
    events = []
    for s in range(pp):
        for j in range(m):
            t = (s + 3 * j) * 1e-3
            events.append(Event(unit="llm", stage=s, replica=0, rank=s, kind="F",
                                microbatch=j, start_s=t, end_s=t + 1e-3))
            events.append(Event(unit="llm", stage=s, replica=0, rank=s, kind="B",
                                microbatch=j, start_s=t + 1e-3, end_s=t + 3e-3))
    return Timeline(source="predicted", num_microbatches=m, units=(unit,),
                    events=tuple(events))


def _compile_72b() -> int:
    with tempfile.TemporaryDirectory() as out:
        return cli.main(["compile", str(ROOT / "specs" / "mllm_72b.dt"), "-o",
                         str(Path(out) / "b"), "--synthetic"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for name in SHIPPED:
        the_plan = plan(cost(name), compare_baseline=False)
        _, median, best = timed(lambda p=the_plan, n=name: lower(p, shipped(n)),
                                args.repeats)
        rows.append((f"lower {name}", median, best, 2.0))
    base = Schedule.skeleton("1f1b", 256, (ScheduleUnit(name="llm", role="backbone", tp=1,
                                                        dp=1, pp=32, vpp=1),))
    _, median, best = timed(lambda: lower_units(base, GradientFlow.everywhere(base)),
                            args.repeats)
    rows.append(("lower 1f1b 32 x 256", median, best, 5.0))
    tl = _big_timeline()
    render_gantt(tl)        # fonts and imports
    _, median, best = timed(lambda: render_gantt(tl), args.repeats)
    rows.append(("gantt 32 x 256", median, best, 3.0))
    status, median, best = timed(_compile_72b, 1)
    assert status == 0, status
    rows.append(("dtc compile mllm_72b", median, best, 10.0))
    print(f"{'step':<24} {'median':>9} {'best':>9} {'target':>8}")
    for what, median, best, target in rows:
        flag = "" if best <= target else "  over"
        print(f"{what:<24} {median:>8.3f}s {best:>8.3f}s {target:>7.1f}s{flag}")


if __name__ == "__main__":
    main()
