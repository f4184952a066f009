"""``dtc compile``: write a launch bundle: rank programs, preprocessing workers, launch.sh,
slurm.sbatch."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from dtdsl.cli.common import (
    add_placement,
    add_plan_options,
    cost_model,
    open_program,
    runtime_plan,
    slurm_option,
    spec_dir,
)
from dtdsl.clihelp import EXIT_ERRORS, EXIT_OK, non_negative, positive_int
from dtdsl.codegen.slurm import slurm_name, slurm_time
from dtdsl.diagnostics import has_errors, render_text
from dtdsl.driver import FrontendResult, UsageError
from dtdsl.ir.program import Program

__all__ = ["HELP", "NAME", "add_arguments", "run"]

NAME = "compile"
HELP = ("write a launch bundle: rank programs, "
                          "preprocessing workers, launch.sh, slurm.sbatch")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", metavar="SPEC", help="spec file ('-' for stdin)")
    parser.add_argument("-o", "--output", required=True, metavar="DIR",
                        help="the bundle directory (created; must be new or empty)")
    add_plan_options(parser)
    parser.add_argument("--steps", type=positive_int, metavar="N",
                        help="training steps (default: the spec's train.steps)")
    parser.add_argument("--workers", type=non_negative, metavar="N",
                        help="preprocessing worker processes, spread over the nodes: each "
                        "node runs ceil(N / nodes) for its own trainers (default: "
                        "cluster.cpu_workers; 0 builds batches inside the trainers)")
    parser.add_argument("--data", metavar="SOURCE", help="the data: a dataset directory or "
                        "WebDataset shards (a folder, a brace pattern; default: the spec's "
                        "data.source, relative to the spec)")
    parser.add_argument("--synthetic", action="store_true",
                        help="train on samples drawn from the spec's distributions")
    parser.add_argument("--time", type=slurm_option(slurm_time), metavar="LIMIT",
                        help="slurm.sbatch's time limit (#SBATCH --time: MINUTES, HH:MM:SS, "
                        "D-HH:MM:SS, ...; default: a commented line to fill in)")
    parser.add_argument("--partition", type=slurm_option(slurm_name, "partition"), metavar="P",
                        help="slurm.sbatch's partition (#SBATCH --partition)")
    parser.add_argument("--account", type=slurm_option(slurm_name, "account"), metavar="A",
                        help="slurm.sbatch's account (#SBATCH --account)")
    parser.add_argument("--max-restarts", type=non_negative, metavar="N",
                        help="torchrun restarts after a failed rank, each resuming from the "
                        "newest checkpoint (default 3)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an earlier bundle in DIR (its run directories are kept)")
    add_placement(parser, given_plan=True)


def run(args: argparse.Namespace) -> int:
    from dtdsl.codegen.compile import BundleOptions, compile_bundle
    from dtdsl.codegen.emit import BundleError
    from dtdsl.codegen.slurm import SlurmOptions

    result, program = open_program(args.spec)
    if args.data is not None and args.synthetic:
        raise UsageError("--data names a dataset and --synthetic draws samples instead: "
                         "give one or the other")
    if not args.synthetic and not _data_ready(args, result, program):
        return EXIT_ERRORS
    # What the runtime cannot train is an error before anything is written.
    cost = cost_model(args, program)
    planned = runtime_plan(args.plan, result, program, cost, args.placement)
    if planned is None:
        return EXIT_ERRORS
    the_plan, schedule = planned
    options = BundleOptions(
        steps=args.steps, workers=args.workers, data=args.data, synthetic=args.synthetic,
        max_restarts=args.max_restarts, cost=cost,
        slurm=SlurmOptions(time=args.time, partition=args.partition, account=args.account))
    try:
        written = compile_bundle(args.output, source=result.source.text.encode("utf-8"),
                                 spec_path=args.spec, program=program, plan=the_plan,
                                 schedule=schedule, options=options, overwrite=args.overwrite)
    except (BundleError, ValueError) as err:
        raise UsageError(str(err)) from None
    ranks = the_plan.gpus_used
    # Several nodes (more ranks than a node has GPUs): Slurm, or launch.sh on every node.
    # Quoted: the line is for pasting into a shell, whatever the folder's name holds.
    how = (f"sbatch {shlex.quote(str(Path(args.output) / 'slurm.sbatch'))}"
           if ranks > program.cluster.gpus_per_node else
           shlex.quote(str(Path(args.output) / "launch.sh")))
    print(f"dtc: wrote {len(written)} files to {args.output} ({ranks} ranks); launch with "
          f"{how}", file=sys.stderr)
    return EXIT_OK


def _data_ready(args: argparse.Namespace, result: FrontendResult, program: Program) -> bool:
    """Whether the data a bundle will train on can be read: ``--data``, else the spec's
    source (DT314 at its line otherwise). A spec without a source needs ``--data`` or
    ``--synthetic``: a bundle never falls back to drawn samples by itself."""
    from dtdsl.data.sources import (
        data_diagnostics,
        is_synthetic,
        source_problem,
    )

    if args.data is not None:
        problem = source_problem(args.data, Path.cwd())
        if problem is not None:
            raise UsageError(f"--data {args.data}: {problem}")
        if program.data.tokenizer is None and not is_synthetic(args.data, Path.cwd()):
            raise UsageError(f"--data {args.data} is real text, which needs a tokenizer: add "
                             '`tokenizer = "PATH"` to the spec\'s data block (the hashing '
                             "tokenizer is only for synthetic data)")
        return True
    if program.data.source is None:
        raise UsageError("the spec's data block names no source: give --data SOURCE (a "
                         "dataset, WebDataset shards, a LLaVA JSON) or --synthetic (samples "
                         "drawn from the spec's distributions)")
    found = data_diagnostics(program, spec_dir(result.name))
    if found:
        # Warnings (samples left out, a module the data gives nothing) are said and the
        # bundle written; an error stops it.
        assert result.source is not None
        sys.stderr.write(render_text(found, result.source, result.name))
    return not has_errors(found)

