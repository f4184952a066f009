"""``dtc simulate``: simulate training steps of a plan: TensorBoard scalars and Gantt
charts, a Perfetto trace."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from dtdsl.cli.common import (
    add_placement,
    add_plan_options,
    cost_model,
    open_program,
    plan_and_schedule,
)
from dtdsl.clihelp import EXIT_ERRORS, EXIT_OK, check_output, gpu_count, positive_int
from dtdsl.driver import UsageError

__all__ = ["HELP", "NAME", "add_arguments", "run"]

TRACE_STEPS = 8   # steps in the Perfetto trace (TensorBoard gets them all)

NAME = "simulate"
HELP = ("simulate training steps of a plan: TensorBoard "
                         "scalars and Gantt charts, a Perfetto trace")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", metavar="SPEC", help="spec file ('-' for stdin)")
    add_plan_options(parser)
    parser.add_argument("--gpus", type=gpu_count, metavar="N",
                        help="plan for N GPUs instead of the spec's cluster")
    parser.add_argument("--steps", type=positive_int, default=4,
                        help="training steps (global batches) to simulate (default 4)")
    parser.add_argument("--reorder", choices=("none", "intra", "inter", "both"),
                        help="sample reordering (default: the spec's train.reorder)")
    parser.add_argument("--logdir", required=True, metavar="DIR",
                        help="TensorBoard log directory (also gets trace.json)")
    parser.add_argument("--overwrite", action="store_true",
                        help="delete the event files of an earlier run in --logdir")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    add_placement(parser, given_plan=True)


def run(args: argparse.Namespace) -> int:
    from dtdsl.reorder.workload import WorkModel, parse_policy
    from dtdsl.report import plan_markdown, progress_bar, wide_console
    from dtdsl.sim.report import simulation_report
    from dtdsl.sim.run import simulate_steps
    from dtdsl.sim.simulate import Simulator
    from dtdsl.sim.tensorboard import TimelineWriter
    from dtdsl.sim.trace import is_trace, write_trace

    result, program = open_program(args.spec)
    cost = cost_model(args, program)
    if args.plan:
        if args.gpus:
            raise UsageError("--gpus plans for another cluster size; with --plan the plan "
                             "is given: use one or the other")
    planned = plan_and_schedule(args.plan, result, program, cost, args.gpus,
                                 args.placement)
    if planned is None:
        return EXIT_ERRORS
    the_plan, schedule = planned
    policy = parse_policy(args.reorder if args.reorder else program.train.reorder)
    logdir = Path(args.logdir)
    if logdir.exists() and not logdir.is_dir():
        raise UsageError(f"--logdir {args.logdir} is a file; give a directory (it is "
                         "created if missing)")
    try:
        logdir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"cannot create {args.logdir}: {err.strerror or err}") from None
    # The trace it writes replaces only an earlier one (checked before simulating).
    trace_path = logdir / "trace.json"
    check_output(str(trace_path), is_trace, "a trace")
    earlier = sorted(logdir.glob("events.out.tfevents.*"))
    if earlier and not args.overwrite:
        raise UsageError(f"--logdir {args.logdir} already holds TensorBoard events of an "
                         f"earlier run ({len(earlier)} file{'s' if len(earlier) > 1 else ''}); "
                         "TensorBoard would mix the runs: give a new directory, or "
                         "--overwrite to delete them")
    try:
        for path in earlier:
            path.unlink()
        # Try a file first: a SummaryWriter that cannot write leaves a thread that prints
        # a traceback at exit.
        with tempfile.TemporaryFile(dir=logdir):
            pass
        writer = TimelineWriter(logdir)
    except OSError as err:
        raise UsageError(f"cannot write to {args.logdir}: {err.strerror or err}") from None
    steps, baseline, timelines = [], [], []
    shared = {"simulator": Simulator(schedule), "work_model": WorkModel(cost)}
    with progress_bar("simulating") as progress, writer:
        writer.add_text("plan", plan_markdown(the_plan))
        for k, step in enumerate(simulate_steps(program, cost, the_plan, schedule,
                                                steps=args.steps, policy=policy, **shared)):
            timeline = step.result.timeline(step=step.step)
            writer.add_step(step.step, timeline, step.scalars())
            if k < TRACE_STEPS:   # a paper-scale step has ~50k events: keep the trace small
                timelines.append(timeline)
            steps.append(step)
            progress(k + 1, args.steps, f"step {step.step}")
        if policy:
            baseline = list(simulate_steps(program, cost, the_plan, schedule,
                                           steps=args.steps, policy=frozenset(), **shared))
    check_output(str(trace_path), is_trace, "a trace")
    try:
        write_trace(trace_path, timelines)
    except OSError as err:
        raise UsageError(f"cannot write {trace_path}: {err.strerror or err}") from None
    report = simulation_report(the_plan, steps, baseline, policy, logdir=str(logdir),
                               trace=str(trace_path), trace_steps=len(timelines))
    if args.json:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        from dtdsl.sim.report import render_simulation

        render_simulation(report, wide_console())
    return EXIT_OK

