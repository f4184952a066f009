"""``dtc check``: check specs and report every problem."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence

from dtdsl.cli.common import solve, spec_dir, usage_diagnostic
from dtdsl.clihelp import EXIT_ERRORS, EXIT_OK, EXIT_USAGE
from dtdsl.diagnostics import Diagnostic, render_json, render_text
from dtdsl.driver import STAGES, UsageError, read_spec, run_frontend
from dtdsl.frontend.ast import dump_ast

__all__ = ["HELP", "NAME", "add_arguments", "run"]

NAME = "check"
HELP = "check specs and report every problem"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("specs", nargs="+", metavar="SPEC", help="spec files ('-' for stdin)")
    parser.add_argument("--format", choices=("text", "json"), default="text")
    parser.add_argument("--emit", choices=(*STAGES, "graph", "plan", "schedule"),
                        help="print the text form of a stage (ast: the syntax tree with spans; "
                        "program: the resolved program as JSON; graph: the stage graph; "
                        "plan: the plan as JSON; schedule: every stage's actions)")
    parser.add_argument("--synthetic", action="store_true",
                        help="do not check that the data source can be read (a spec planned, "
                        "or compiled to train on samples drawn from its distributions; "
                        "--emit does not check it either)")
    parser.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")


def run(args: argparse.Namespace) -> int:
    results: list[tuple[str, Sequence[Diagnostic]]] = []
    exit_code = EXIT_OK
    texts = []
    for path in args.specs:
        try:
            name, data = read_spec(path)
        except UsageError as err:
            if args.format == "json":
                results.append((path, [usage_diagnostic(str(err))]))
            else:
                print(f"dtc: error: {err}", file=sys.stderr)
            exit_code = EXIT_USAGE
            continue
        stop = args.emit if args.emit in STAGES else "program"
        result = run_frontend(name, data, stop_after=stop)
        if result.ok and result.program is not None and not args.synthetic and not args.emit:
            # The data the spec names must be readable (not part of the pure front end:
            # it reads the file system).
            from dtdsl.data.sources import data_diagnostics

            more = data_diagnostics(result.program, spec_dir(name))
            if more:
                result = dataclasses.replace(result, diagnostics=(*result.diagnostics, *more))
        results.append((name, result.diagnostics))
        if not result.ok:
            exit_code = max(exit_code, EXIT_ERRORS)
        if args.format == "text" and result.diagnostics:
            # Diagnostics, warnings included, go to stderr: stdout carries only --emit's text.
            sys.stderr.write(render_text(result.diagnostics, result.source, result.name))
        if result.ok and args.emit == "ast" and result.spec is not None:
            texts.append(dump_ast(result.spec))
        elif result.ok and args.emit == "program" and result.program is not None:
            texts.append(result.program.model_dump_json(indent=2) + "\n")
        elif result.ok and args.emit == "graph" and result.program is not None:
            from dtdsl.cost.graph import build_graph, graph_text

            texts.append(graph_text(build_graph(result.program)))
        elif result.ok and args.emit in ("plan", "schedule") and result.program is not None:
            the_plan = solve(result, result.program, None)
            if the_plan is None:
                exit_code = max(exit_code, EXIT_ERRORS)
            elif args.emit == "plan":
                texts.append(the_plan.model_dump_json(indent=2) + "\n")
            else:
                from dtdsl.ir.schedule import schedule_text
                from dtdsl.schedule.lower import lower

                texts.append(schedule_text(lower(the_plan, result.program)))
    if args.format == "json":
        if args.emit and exit_code == EXIT_OK:
            sys.stdout.write("".join(texts))  # --emit prints the stage's text form
        else:
            sys.stdout.write(render_json(results))
    else:
        if exit_code == EXIT_OK:
            sys.stdout.write("".join(texts))
        if exit_code == EXIT_OK and not args.emit and not args.quiet:
            print(f"checked {len(args.specs)} spec{'s' if len(args.specs) != 1 else ''}: "
                  "no errors", file=sys.stderr)
    return exit_code

