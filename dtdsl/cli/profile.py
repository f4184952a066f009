"""``dtc profile``: measure every module's forward and backward time on this machine."""

from __future__ import annotations

import argparse
import re
import sys

from dtdsl.cli.common import open_program
from dtdsl.clihelp import EXIT_OK, check_output, non_negative, parses_as, positive_int
from dtdsl.driver import UsageError

__all__ = ["HELP", "NAME", "add_arguments", "run"]

NAME = "profile"
HELP = ("measure every module's forward and backward time "
                          "on this machine")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", metavar="SPEC", help="spec file ('-' for stdin)")
    parser.add_argument("-o", "--output", metavar="FILE", required=True,
                        help="where to write the profile JSON")
    parser.add_argument("--tp", metavar="DEGREES",
                        help="TP degrees to measure, e.g. 1,2,4 (default: those each module "
                        "allows up to 8)")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="timed passes per point (the median is kept)")
    parser.add_argument("--warmup", type=non_negative, default=1,
                        help="untimed passes per point")
    parser.add_argument("--device", type=_device,
                        help="cpu, cuda or cuda:N (default: cuda when there is one)")
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="torch CPU threads while measuring (default 1)")
    parser.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")


def run(args: argparse.Namespace) -> int:
    from dtdsl.cost.profile import Profile, save_profile
    from dtdsl.report import progress_bar, render_profile, wide_console
    from dtdsl.train.profile import profile_program

    _, program = open_program(args.spec)
    # A file in the way stops it before the measuring, not after.
    check_output(args.output, parses_as(Profile), "a profile")
    tps = None
    if args.tp:
        try:
            degrees = tuple(sorted({int(t) for t in args.tp.split(",")}))
        except ValueError:
            raise UsageError(f"--tp takes TP degrees such as 1,2,4, not {args.tp!r}") from None
        tps = {name: degrees for name in
               [m.name for m in program.modules] + [p.name for p in program.projectors]}
    try:
        with progress_bar("profiling") as progress:
            profile = profile_program(program, tps=tps, repeats=args.repeats,
                                      warmup=args.warmup, device=args.device,
                                      num_threads=args.threads, progress=progress)
    except ValueError as err:
        raise UsageError(str(err)) from None
    check_output(args.output, parses_as(Profile), "a profile")
    save_profile(profile, args.output)
    if not args.quiet:
        render_profile(profile, wide_console(stderr=True))
        print(f"wrote {args.output}", file=sys.stderr)
    return EXIT_OK


def _device(text: str) -> str:
    """``--device``: cpu, cuda or cuda:N (argparse's one-line error otherwise)."""
    if re.fullmatch(r"cpu|cuda(:\d+)?", text) is None:
        raise argparse.ArgumentTypeError(f"cpu, cuda or cuda:N, not {text!r}")
    return text
