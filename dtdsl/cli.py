"""``dtc``: the dtdsl compiler's command line.

Exit codes: 0 no errors, 1 errors in a spec (or `fmt --check` found changes),
2 bad command-line usage, 3 an internal compiler error. A user never sees a
Python traceback unless they pass ``--debug``.
"""

from __future__ import annotations

import argparse
import difflib
import sys
import traceback
from collections.abc import Sequence

from dtdsl import __version__
from dtdsl.codes import CODES, explain
from dtdsl.diagnostics import Diagnostic, render_json, render_text
from dtdsl.driver import STAGES, UsageError, read_spec, run_frontend
from dtdsl.frontend.ast import dump_ast
from dtdsl.frontend.fmt import format_spec
from dtdsl.source import Span

__all__ = ["main"]

EXIT_OK, EXIT_ERRORS, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3
BUG_REPORT = "https://github.com/dtdsl/dtdsl/issues"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own usage errors: exit 2, no traceback
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"dtc: error: {message}\n")


def _usage_diagnostic(message: str) -> Diagnostic:
    return Diagnostic.error("DT000", message, Span.point(1, 1))


def _cmd_check(args: argparse.Namespace) -> int:
    results: list[tuple[str, Sequence[Diagnostic]]] = []
    exit_code = EXIT_OK
    texts = []
    for path in args.specs:
        try:
            name, data = read_spec(path)
        except UsageError as err:
            if args.format == "json":
                results.append((path, [_usage_diagnostic(str(err))]))
            else:
                print(f"dtc: error: {err}", file=sys.stderr)
            exit_code = EXIT_USAGE
            continue
        stop = args.emit if args.emit in STAGES else "program"
        result = run_frontend(name, data, stop_after=stop)
        results.append((name, result.diagnostics))
        if not result.ok:
            exit_code = max(exit_code, EXIT_ERRORS)
        if args.format == "text" and result.diagnostics:
            texts.append(render_text(result.diagnostics, result.source, result.name))
        if result.ok and args.emit == "ast" and result.spec is not None:
            texts.append(dump_ast(result.spec))
        elif result.ok and args.emit == "program" and result.program is not None:
            texts.append(result.program.model_dump_json(indent=2) + "\n")
    if args.format == "json":
        if args.emit and exit_code == EXIT_OK:
            sys.stdout.write("".join(texts))  # --emit prints the stage's text form
        else:
            sys.stdout.write(render_json(results))
    else:
        out = "".join(texts)
        (sys.stdout if exit_code == EXIT_OK else sys.stderr).write(out)
        if exit_code == EXIT_OK and not args.emit and not args.quiet:
            print(f"checked {len(args.specs)} spec{'s' if len(args.specs) != 1 else ''}: "
                  "no errors", file=sys.stderr)
    return exit_code


def _cmd_fmt(args: argparse.Namespace) -> int:
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
            with open(path, "w", encoding="utf-8", newline="\n") as f:
                f.write(formatted)
            print(f"reformatted {name}", file=sys.stderr)
    return exit_code


def _cmd_explain(args: argparse.Namespace) -> int:
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


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dtc", description="dtdsl: compile multimodal LLM training specs.")
    parser.add_argument("--version", action="version", version=f"dtc {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an internal compiler error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    check = sub.add_parser("check", help="check specs and report every problem")
    check.add_argument("specs", nargs="+", metavar="SPEC", help="spec files ('-' for stdin)")
    check.add_argument("--format", choices=("text", "json"), default="text")
    check.add_argument("--emit", choices=STAGES,
                       help="print the text form of a stage (ast: the syntax tree with spans; "
                       "program: the resolved program as JSON)")
    check.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")
    check.set_defaults(func=_cmd_check)

    fmt = sub.add_parser("fmt", help="rewrite specs in the canonical layout")
    fmt.add_argument("specs", nargs="+", metavar="SPEC", help="spec files ('-': stdin to stdout)")
    fmt.add_argument("--check", action="store_true",
                     help="change nothing; exit 1 if a spec is not formatted")
    fmt.add_argument("--diff", action="store_true", help="print the changes instead of writing")
    fmt.set_defaults(func=_cmd_fmt)

    expl = sub.add_parser("explain", help="explain a diagnostic code (all codes without one)")
    expl.add_argument("code", nargs="?", metavar="CODE")
    expl.set_defaults(func=_cmd_explain)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return args.func(args)
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
              "(rerun with --debug for the traceback).", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
