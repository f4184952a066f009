"""``dtc memcheck``: measure every stage's peak memory on fake tensors (the runtime's real
modules, one rank per stage) next to the planner's prediction."""

from __future__ import annotations

import argparse
import json
import os
import sys

from dtdsl.cli.common import add_placement, add_plan_options, cost_model, open_program, runtime_plan
from dtdsl.clihelp import EXIT_ERRORS, EXIT_OK, positive_int

__all__ = ["HELP", "NAME", "add_arguments", "run"]

NAME = "memcheck"
HELP = ("measure every stage's peak memory on fake "
                         "tensors (the runtime's real modules, one rank per stage) next to "
                         "the planner's prediction")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", metavar="SPEC", help="spec file ('-' for stdin)")
    add_plan_options(parser)
    parser.add_argument("--json", action="store_true", help="print JSON: {\"stages\": [...]}")
    parser.add_argument("--jobs", type=positive_int, default=os.cpu_count() or 1, metavar="N",
                        help="stages measured at once, each in a process of its own (default: "
                        "the CPU count)")
    parser.add_argument("--every-microbatch", action="store_true",
                        help="run every microbatch a stage keeps in flight (default: three, "
                        "each of the others holding what an average one held: the same "
                        "peak, in time that does not grow with the pipeline's depth)")
    add_placement(parser, given_plan=True)


def run(args: argparse.Namespace) -> int:
    from dtdsl.report import progress_bar
    from dtdsl.train.memplan import check_memory, format_stages

    result, program = open_program(args.spec)
    cost = cost_model(args, program)
    # Only what the runtime can build can be measured: dtc compile's diagnostics.
    planned = runtime_plan(args.plan, result, program, cost, args.placement)
    if planned is None:
        return EXIT_ERRORS
    the_plan, _ = planned
    with progress_bar("memcheck", enabled=not args.json and sys.stderr.isatty()) as bar:
        stages = check_memory(program, the_plan, cost=cost, jobs=args.jobs, progress=bar,
                              every_microbatch=args.every_microbatch)
    if args.json:
        print(json.dumps({"stages": [s.as_json() for s in stages]}, indent=2))
    else:
        print("\n".join(format_stages(stages)))
    over = [s for s in stages if s.total_bytes > s.capacity_bytes]
    return EXIT_ERRORS if over else EXIT_OK

