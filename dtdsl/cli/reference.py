"""``dtc reference``: train the spec single-process in fp32 on the CPU: the per-step losses
a distributed run must match."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from dtdsl.cli.common import open_program, read_plan, refused, solve
from dtdsl.clihelp import EXIT_ERRORS, EXIT_OK, check_output, positive_int, replacing
from dtdsl.driver import UsageError

__all__ = ["HELP", "NAME", "add_arguments", "run"]

NAME = "reference"
HELP = ("train the spec single-process in fp32 on the CPU: "
                         "the per-step losses a distributed run must match")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", metavar="SPEC", help="spec file ('-' for stdin)")
    parser.add_argument("--steps", type=positive_int, metavar="N",
                        help="training steps (default: the spec's train.steps)")
    parser.add_argument("--out", metavar="FILE",
                        help="write one JSON line per step here (default: stdout)")
    parser.add_argument("--micro-batch", type=positive_int, metavar="M",
                        help="samples per microbatch (default: the spec's train.micro_batch)")
    parser.add_argument("--seed", type=int, help="initialisation seed (default: train.seed)")
    parser.add_argument("--data", metavar="DIR", help="train on this dataset's batches (as a "
                        "launched bundle reads them) instead of the spec's synthetic samples")
    parser.add_argument("--plan", metavar="FILE", help="with sync = local_sgd: the plan (`dtc "
                        "plan -o`) whose replicas and routing to follow (default: the plan dtc "
                        "plan gives)")
    parser.add_argument("--threads", type=positive_int, help="torch CPU threads")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")


def run(args: argparse.Namespace) -> int:
    import time

    import torch

    from dtdsl.train.reference import train_reference

    result, program = open_program(args.spec)
    if refused(result, program):        # what the runtime cannot train, the reference cannot
        return EXIT_ERRORS
    if args.micro_batch is not None and args.micro_batch > program.train.global_batch:
        raise UsageError(f"--micro-batch {args.micro_batch} is larger than the global batch "
                         f"of {program.train.global_batch}")
    _fits_in_memory(program)
    steps = args.steps or program.train.steps
    source = None
    if args.data is not None:
        from dtdsl.data.shards import DatasetError
        from dtdsl.feed.source import DatasetSource

        try:
            source = DatasetSource(program, args.data)
        except (DatasetError, ValueError) as err:
            raise UsageError(f"cannot read dataset {args.data}: {err}") from None
    # A file: new, or an earlier run's output (never another file), checked before the work;
    # the lines go to a temporary file beside it, renamed into place when all are written.
    target = None if args.out in (None, "-") else \
        check_output(args.out, _reference_lines, "a dtc reference output")
    if args.threads:
        torch.set_num_threads(args.threads)
    the_plan = None
    if program.train.sync.local:
        # Local SGD's replicas train on the samples the plan routes to them.
        the_plan = read_plan(args.plan, program) if args.plan else \
            solve(result, program, None)
        if the_plan is None:
            return EXIT_ERRORS
    elif args.plan:
        print("dtc: note: --plan is read only with sync = local_sgd; synchronous data "
              "parallelism has the same losses under every plan", file=sys.stderr)
    start = time.perf_counter()
    with contextlib.nullcontext(sys.stdout) if target is None else replacing(target) as out:
        try:
            for record in train_reference(program, steps, micro_batch=args.micro_batch,
                                          seed=args.seed, source=source, plan=the_plan):
                out.write(json.dumps(record) + "\n")
                out.flush()
                if not args.quiet:
                    print(f"step {record['step'] + 1}/{steps}  loss {record['loss']:.6f}  "
                          f"({time.perf_counter() - start:.1f} s)", file=sys.stderr)
        except ValueError as err:
            raise UsageError(f"cannot train {result.name}: {err}") from None
    return EXIT_OK


def _reference_lines(data: bytes) -> bool:
    """``check_output``'s ``ours``: JSON lines, each a step's record with its loss."""
    try:
        lines = data.decode("utf-8").splitlines()
        records = [json.loads(line) for line in lines]
    except (UnicodeDecodeError, ValueError, RecursionError):
        return False
    return bool(records) and all(isinstance(r, dict) and {"step", "loss"} <= r.keys()
                                 for r in records)


def _fits_in_memory(program) -> None:
    """UsageError where the whole model's fp32 training state (weights, gradients and
    Adam's moments: the cost model's bytes per parameter) is more than this machine's
    memory: the reference trains every module in one process, and a paper-scale spec
    would only thrash and be killed."""
    import os

    from dtdsl.cost import flops
    from dtdsl.cost.model import param_bytes
    from dtdsl.report import format_bytes

    params = flops.program_params(program)
    need = params * param_bytes("fp32")
    try:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return
    if need > have:
        raise UsageError(f"dtc reference trains {program.name} whole, in one process, in "
                         f"fp32: its {params / 1e9:.2f}B parameters need at least "
                         f"{format_bytes(need)} for weights, gradients and Adam's moments, "
                         f"and this machine has {format_bytes(have)}; it is for specs "
                         "small enough to train on one machine (the bundle spreads a large "
                         "one over its GPUs)")
