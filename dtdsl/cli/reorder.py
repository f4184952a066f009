"""``dtc reorder``: run a reordering policy on given sample costs."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dtdsl.clihelp import EXIT_OK, positive_int
from dtdsl.driver import UsageError

__all__ = ["HELP", "NAME", "add_arguments", "run"]

NAME = "reorder"
HELP = "run a reordering policy on given sample costs"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    reo_sub = parser.add_subparsers(dest="policy", metavar="POLICY", required=True)
    intra = reo_sub.add_parser("intra", help="balance samples over DP groups of equal count")
    intra.add_argument("--costs", required=True, metavar="FILE",
                       help="a JSON list of per-sample costs ('-' for stdin)")
    intra.add_argument("--groups", required=True, type=positive_int, metavar="G",
                       help="number of data-parallel groups")
    intra.add_argument("--json", action="store_true", help="print the result as JSON")
    inter = reo_sub.add_parser("inter", help="order microbatches for 1F1B")
    inter.add_argument("--costs", required=True, metavar="FILE",
                       help='a JSON object {"forward": [...], "backward": [...], '
                       '"stage_forward": f, "stage_backward": b} (\'-\' for stdin)')
    inter.add_argument("--stages", required=True, type=positive_int, metavar="P",
                       help="pipeline stages: the first takes the per-microbatch times, "
                       "P-1 more take stage_forward and stage_backward")
    inter.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    data = _read_costs(args.costs)
    try:
        if args.policy == "intra":
            from dtdsl.reorder.intra import report

            if not isinstance(data, list):
                raise ValueError("expected a JSON list of per-sample costs")
            out = report(data, args.groups)
        else:
            from dtdsl.reorder.inter import report

            keys = ("forward", "backward", "stage_forward", "stage_backward")
            if not isinstance(data, dict) or any(k not in data for k in keys):
                raise ValueError('expected a JSON object {"forward": [...], "backward": [...], '
                                 '"stage_forward": f, "stage_backward": b}')
            extra = sorted(set(data) - set(keys))
            if extra:
                raise ValueError(f"unknown key{'s' if len(extra) > 1 else ''} "
                                 f"{', '.join(extra)}; expected {', '.join(keys)}")
            out = report(data["forward"], data["backward"], data["stage_forward"],
                         data["stage_backward"], args.stages)
    except ValueError as err:
        raise UsageError(f"{args.costs}: {err}") from None
    if args.json:
        sys.stdout.write(json.dumps(out) + "\n")
    else:
        from dtdsl.report import wide_console
        from dtdsl.sim.report import render_reorder

        render_reorder(args.policy, out, wide_console())
    return EXIT_OK


def _read_costs(path: str) -> object:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
        return json.loads(text)
    except OSError as err:
        raise UsageError(f"cannot read costs {path}: {err.strerror or err}") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise UsageError(f"costs {path} is not JSON: {err}") from None

