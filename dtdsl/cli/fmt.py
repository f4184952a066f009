"""``dtc fmt``: rewrite specs in the canonical layout."""

from __future__ import annotations

import argparse
import difflib
import os
import stat
import sys
from pathlib import Path

from dtdsl.clihelp import EXIT_ERRORS, EXIT_OK, EXIT_USAGE, replacing
from dtdsl.diagnostics import render_text
from dtdsl.driver import UsageError, read_spec, run_frontend
from dtdsl.frontend.fmt import format_spec

__all__ = ["HELP", "NAME", "add_arguments", "run"]

NAME = "fmt"
HELP = "rewrite specs in the canonical layout"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("specs", nargs="+", metavar="SPEC",
                        help="spec files ('-': stdin to stdout)")
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if a spec is not formatted")
    parser.add_argument("--diff", action="store_true", help="print the changes instead of writing")


def run(args: argparse.Namespace) -> int:
    exit_code = EXIT_OK
    for path in args.specs:
        try:
            name, data = read_spec(path)
        except UsageError as err:
            print(f"dtc: error: {err}", file=sys.stderr)
            exit_code = EXIT_USAGE
            continue
        result = run_frontend(name, data, stop_after="ast")
        if result.spec is None:
            sys.stderr.write(render_text(result.diagnostics, result.source, result.name))
            exit_code = max(exit_code, EXIT_ERRORS)
            continue
        original = result.source.text
        formatted = format_spec(result.spec)
        if path == "-" and not (args.check or args.diff):
            sys.stdout.write(formatted)
            continue
        if formatted == original:
            continue
        if args.diff:
            sys.stdout.writelines(difflib.unified_diff(
                original.splitlines(keepends=True), formatted.splitlines(keepends=True),
                fromfile=name, tofile=f"{name} (formatted)"))
        if args.check:
            print(f"would reformat {name}", file=sys.stderr)
            exit_code = max(exit_code, EXIT_ERRORS)
        elif not args.diff:
            # Whole or not at all (a full disk leaves the spec as it was), through a link
            # to the file it names, which keeps its mode.
            real = Path(os.path.realpath(path))
            with replacing(real, mode=stat.S_IMODE(os.stat(real).st_mode)) as f:
                f.write(formatted)
            print(f"reformatted {name}", file=sys.stderr)
    return exit_code

