"""``dtc export``: write a run's checkpoint as Hugging Face model directories, one per unit
(transformers / diffusers load them)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dtdsl.cli.common import open_program
from dtdsl.clihelp import EXIT_OK, positive_int
from dtdsl.driver import UsageError

__all__ = ["HELP", "NAME", "add_arguments", "run"]

NAME = "export"
HELP = ("write a run's checkpoint as Hugging Face model "
                         "directories, one per unit (transformers / diffusers load them)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (its newest "
                        "checkpoint) or a checkpoint directory")
    parser.add_argument("--step", type=positive_int, metavar="N",
                        help="the checkpoint after N steps (default: the newest)")
    parser.add_argument("-o", "--output", required=True, metavar="DIR",
                        help="where to write: DIR/<unit>/ for each unit")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"),
                        help="cast the weights (default: as trained, fp32)")
    parser.add_argument("--units", metavar="A,B", help="only these units (default: all)")
    parser.add_argument("--spec", metavar="SPEC", help="the spec it was trained from, for a "
                        "checkpoint that does not carry its program.json")
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty DIR")


def run(args: argparse.Namespace) -> int:
    from dtdsl.train.export import export_checkpoint

    program = None
    if args.spec is not None:
        _, program = open_program(args.spec)
    out = Path(args.output)
    if out.is_symlink():
        raise UsageError(f"{out} is a symbolic link; dtdsl does not write through links: "
                         "give the real folder, or a new one")
    if out.is_dir() and any(out.iterdir()) and not args.overwrite:
        raise UsageError(f"{out} is not empty; pass --overwrite to write into it")
    units = None
    if args.units is not None:
        units = tuple(u for u in args.units.split(",") if u)
        if not units:
            raise UsageError(f"--units {args.units!r} names no unit: name them (A,B), or "
                             "leave --units out to export every one")
    # A CheckpointError or HFError is the user's to act on: dtc prints it (DtdslError).
    done = export_checkpoint(args.run_dir, out, step=args.step, dtype=args.dtype,
                             units=units, program=program,
                             log=lambda line: print(f"dtc export: {line}", file=sys.stderr))
    hf = sum(u.hf for u in done)
    print(f"dtc: exported {len(done)} unit{'s' if len(done) != 1 else ''} to {out} "
          f"({hf} as Hugging Face model{'s' if hf != 1 else ''})",
          file=sys.stderr)
    return EXIT_OK

