"""``dtc plan``: choose GPUs and TP/DP/PP for every module."""

from __future__ import annotations

import argparse
import sys

from dtdsl.cli.common import (
    PROGRESS_AFTER_S,
    SIMULATE_STEPS,
    add_placement,
    cost_model,
    open_program,
    report_infeasible,
)
from dtdsl.clihelp import (
    EXIT_ERRORS,
    EXIT_OK,
    gpu_count,
    non_negative,
    parses_as,
    write_file,
)
from dtdsl.driver import UsageError

__all__ = ["HELP", "NAME", "add_arguments", "run"]

NAME = "plan"
HELP = "choose GPUs and TP/DP/PP for every module"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", metavar="SPEC", help="spec file ('-' for stdin)")
    parser.add_argument("--gpus", type=gpu_count, metavar="N",
                        help="plan for N GPUs instead of the spec's cluster.gpus")
    parser.add_argument("--search", choices=("convex", "exhaustive", "baseline"),
                        default="convex", help="convex: DistTrain's Algorithm 1 (default); "
                        "exhaustive: every layout (<= 128 GPUs); baseline: Megatron-LM's "
                        "rigid layout, unpacked (the `megatron` baseline)")
    parser.add_argument("--profile", metavar="PROFILE",
                        help="measured module times from `dtc profile` instead of the "
                        "analytic model")
    parser.add_argument("--efficiency", action="append", metavar="KIND=FRACTION",
                        help="calibrate the analytic model: the fraction of peak FLOPs that "
                        "matmul, attention or conv work reaches (repeatable; a bare "
                        "fraction sets all)")
    parser.add_argument("--json", action="store_true", help="print the Plan as JSON")
    parser.add_argument("-o", "--output", metavar="FILE", help="also write the Plan JSON here")
    parser.add_argument("--simulate-steps", type=non_negative, default=SIMULATE_STEPS,
                        metavar="N",
                        help="plan for N global batches drawn from the spec's data: the "
                        "layouts near the optimum at mean work, ranked by their estimated "
                        "time on those batches, the best two simulated (the fastest there "
                        "is the plan), reported with and without reordering, and each "
                        "Megatron-LM baseline chosen alike (default 2; 0: the mean-work "
                        "prediction only)")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip planning the Megatron-LM baselines (no speedups reported)")
    add_placement(parser, given_plan=False)


def run(args: argparse.Namespace) -> int:
    from dtdsl.ir.plan import Plan
    from dtdsl.planner import EXHAUSTIVE_MAX_GPUS, Infeasible, PlannerError, plan
    from dtdsl.report import progress_bar, render_plan, wide_console

    result, program = open_program(args.spec)
    num_gpus = args.gpus or program.cluster.num_gpus
    if args.search == "exhaustive" and num_gpus > EXHAUSTIVE_MAX_GPUS:
        raise UsageError(f"--search exhaustive tries every layout and stops at "
                         f"{EXHAUSTIVE_MAX_GPUS} GPUs; this plan is for {num_gpus} "
                         "(use --gpus or the convex search)")
    if args.search == "baseline" and args.placement is not None:
        raise UsageError("--placement chooses where dtdsl's planner puts the encoders and "
                         "generators; --search baseline plans Megatron-LM's layout, which "
                         "places them itself: use one or the other")
    cost = cost_model(args, program)
    try:
        # One bar for every phase (the baselines, the search, the drawn batches), each
        # named in its note; shown where planning takes more than two seconds.
        with progress_bar("planning", delay_s=PROGRESS_AFTER_S) as progress:
            the_plan = plan(cost, num_gpus, search=args.search,
                            placement=args.placement or "auto",
                            compare_baseline=not args.no_baseline, progress=progress,
                            simulate_steps=args.simulate_steps)
    except Infeasible as err:
        report_infeasible(err, result, program)
        return EXIT_ERRORS
    except PlannerError as err:
        raise RuntimeError(f"the planner failed: {err}") from err
    text = the_plan.model_dump_json(indent=2) + "\n"
    if args.output:
        write_file(args.output, text, parses_as(Plan), "a plan")
    if args.json:
        sys.stdout.write(text)
    else:
        render_plan(the_plan, wide_console())
    return EXIT_OK

