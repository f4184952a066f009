"""``dtc explain``: explain a diagnostic code (all codes without one)."""

from __future__ import annotations

import argparse
import sys

from dtdsl.clihelp import EXIT_OK, EXIT_USAGE
from dtdsl.codes import CODES, explain

__all__ = ["HELP", "NAME", "add_arguments", "run"]

NAME = "explain"
HELP = "explain a diagnostic code (all codes without one)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("code", nargs="?", metavar="CODE")


def run(args: argparse.Namespace) -> int:
    if args.code is None:
        for code, entry in CODES.items():
            print(f"{code}  {entry.title}")
        return EXIT_OK
    text = explain(args.code)
    if text is None:
        print(f"dtc: error: no diagnostic code {args.code!r}; `dtc explain` lists them",
              file=sys.stderr)
        return EXIT_USAGE
    print(text, end="")
    return EXIT_OK

