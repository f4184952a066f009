"""``dtc``: the dtdsl compiler's command line.

Exit codes: 0 no errors, 1 errors in a spec (or `fmt --check` found changes),
2 bad command-line usage, 3 an internal compiler error. A user never sees a
Python traceback unless they pass ``--debug``.

One module per command, each with ``NAME``, ``HELP``, ``add_arguments(parser)`` and
``run(args) -> exit code``, listed in ``COMMANDS`` in the order ``dtc --help`` shows
them (``dtc data`` and its subcommands are ``data.cli``'s); what they share is in
``cli.common``. Commands that plan or profile import numpy, cvxpy, rich and torch when
they run, so ``dtc check`` and ``dtc fmt`` stay quick to start.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Sequence
from types import ModuleType

from dtdsl import __version__
from dtdsl.cli import (
    check,
    explain,
    export,
    fmt,
    graph,
    memcheck,
    plan,
    profile,
    reference,
    reorder,
    simulate,
)
from dtdsl.cli import compile as compile_cmd
from dtdsl.cli.common import Parser, Stop
from dtdsl.clihelp import EXIT_INTERNAL, EXIT_OK, EXIT_USAGE
from dtdsl.errors import DtdslError

__all__ = ["COMMANDS", "main"]

BUG_REPORT = "https://github.com/dtdsl/dtdsl/issues"

# ``None``: ``dtc data`` (``data.cli.register``), in its place in the help.
COMMANDS: tuple[ModuleType | None, ...] = (
    check, fmt, plan, profile, graph, compile_cmd, None, simulate, reorder, memcheck,
    reference, export, explain)


def _parser() -> Parser:
    parser = Parser(prog="dtc", description="dtdsl: compile multimodal LLM training specs.")
    parser.add_argument("--version", action="version", version=f"dtc {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an internal compiler error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for command in COMMANDS:
        if command is None:
            from dtdsl.data.cli import register as register_data

            register_data(sub)
            continue
        one = sub.add_parser(command.NAME, help=command.HELP)
        command.add_arguments(one)
        one.set_defaults(func=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return args.func(args)
    except Stop as stop:
        return stop.code
    except DtdslError as err:     # bad input (a UsageError, a dataset, a checkpoint, ...)
        print(f"dtc: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("dtc: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return EXIT_OK
    except Exception as err:  # noqa: BLE001 - the one place that turns bugs into exit 3
        if args.debug:
            traceback.print_exc()
        print(f"dtc: internal compiler error: {type(err).__name__}: {err}. This is a bug in "
              f"dtc, not in your spec; please report it at {BUG_REPORT} with the spec "
              f"(rerun as `dtc --debug {args.command} ...` for the traceback).",
              file=sys.stderr)
        return EXIT_INTERNAL
