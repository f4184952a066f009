"""``dtc data synth`` and ``dtc data stats``; ``register`` adds them to dtc's parser.

The commands follow ``dtdsl.cli``'s conventions (and share its helpers through
``dtdsl.clihelp``, since ``dtdsl.cli`` imports this module): a bad command line or an unreadable
dataset is a ``UsageError`` (exit 2), a spec with errors exit 1.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from dtdsl.clihelp import EXIT_OK, load_program, positive_int, write_file

if TYPE_CHECKING:
    from dtdsl.driver import FrontendResult
    from dtdsl.ir.program import Program

__all__ = ["DEFAULT_MAX_SAMPLES", "register"]

DEFAULT_MAX_SAMPLES = 2048   # the default size without data.samples: 4 x the steps' samples


def _default_samples(program: Program) -> int:
    if program.data.samples is not None:
        return program.data.samples
    train = program.train
    return min(4 * train.global_batch * train.steps, DEFAULT_MAX_SAMPLES)


def _output_dir(args: argparse.Namespace, result: FrontendResult, program: Program) -> Path:
    """``-o``, or the spec's ``data.source`` relative to the spec's folder (the rule of
    empirical files)."""
    from dtdsl.driver import UsageError

    if args.output:
        return Path(args.output)
    source = program.data.source
    if source is None:
        raise UsageError(f"{result.name} has no data.source; give the output directory "
                         "with -o DIR")
    if "{" in source or source.endswith(".tar"):
        raise UsageError(f"data.source {source!r} names shard files, not a directory; give "
                         "the output directory with -o DIR")
    path = Path(source)
    if not path.is_absolute():
        base = Path(result.name).resolve().parent if result.name != "<stdin>" else Path.cwd()
        path = base / path
    return path


def _cmd_synth(args: argparse.Namespace) -> int:
    from dtdsl.data.shards import DatasetExists, check_writable, write_dataset
    from dtdsl.data.synth import provenance, synthesize
    from dtdsl.driver import UsageError
    from dtdsl.report import format_bytes, progress_bar

    result, code = load_program(args.spec)
    if result is None:
        return code
    program = result.program
    assert program is not None
    out = _output_dir(args, result, program)
    try:        # before any sample is made: a folder of someone else's files is refused
        check_writable(out, args.overwrite)
    except DatasetExists:   # (any other DatasetError is printed as it is: dtdsl.cli.main)
        raise UsageError(f"{out} holds a dataset: pass --overwrite to replace it (only its "
                         "index and the shards the index lists are removed)") from None
    num_samples = args.samples or _default_samples(program)
    seed = program.train.seed if args.seed is None else args.seed
    start = time.perf_counter()
    try:
        samples = synthesize(program, num_samples, seed)
        with progress_bar(f"synthesising {program.name}") as progress:
            written = write_dataset(
                out, samples, samples_per_shard=args.shard_size, overwrite=args.overwrite,
                provenance=provenance(program, seed),
                progress=lambda done: progress(done, num_samples, ""))
    except ValueError as err:
        raise UsageError(f"cannot synthesise data for {result.name}: {err}") from None
    if not args.quiet:
        shards = f"{written.num_shards} shard{'s' if written.num_shards != 1 else ''}"
        print(f"wrote {written.num_samples:,} samples of {program.name} (seed {seed}) to "
              f"{out}: {shards}, {format_bytes(written.num_bytes)}, "
              f"{time.perf_counter() - start:.1f} s", file=sys.stderr)
    return EXIT_OK


def _cmd_stats(args: argparse.Namespace) -> int:
    from dtdsl.data.stats import (
        DEFAULT_PATCH,
        is_stats_json,
        measure,
        stats_json,
        stats_table,
        summarize,
    )
    from dtdsl.report import wide_console

    patch, max_patches = args.patch or DEFAULT_PATCH, None
    program = policy = None
    if args.spec is not None:
        result, code = load_program(args.spec)
        if result is None:
            return code
        program = result.program
        assert program is not None
        encoder = next((m for m in program.encoders if m.modality == "image"), None)
        if encoder is not None:
            patch = getattr(encoder.arch, "patch", None) or 1
        quantity = program.data.get("image", "patches")
        if quantity is not None and quantity.high is not None:
            max_patches = int(quantity.high)
        if encoder is not None:
            from dtdsl.data.images import ImagePolicy

            policy = ImagePolicy.for_encoder(encoder, max_patches,
                                             block=program.image_tokens().block)
    readers = None
    if program is not None:
        from dtdsl.data.media import ClipReader

        readers = {}
        for m in program.encoders:
            if m.modality in ("audio", "video") and m.modality not in readers:
                readers[m.modality] = ClipReader.for_encoder(program, m)
    program = program if args.spec is not None else None
    tokenizer = _tokenizer(args, program)
    with _open(args.dataset, program, image_folder=args.image_folder) as dataset:
        told = _left_out(args.dataset, dataset)
        values = measure(dataset, patch=patch, max_patches=max_patches,
                         tokenizer=tokenizer, images=policy, readers=readers)
        title = (f"{args.dataset}: {len(dataset):,} samples in "
                 f"{len(dataset.shard_names)} shards (image patches of {patch} px; "
                 + (f"text tokens of {tokenizer.path}" if tokenizer is not None else
                    "text in words and marks, no tokenizer given") + ")")
    if told:
        title += "; " + told
    text = stats_json(values)
    if args.output:
        write_file(args.output, text, is_stats_json, "a stats JSON")
    if args.json:
        sys.stdout.write(text)
    else:
        console = wide_console()
        console.print(title, markup=False, highlight=False)
        console.print(stats_table(summarize(values)))
    return EXIT_OK


def _left_out(source: str, dataset, unusable: int = 0) -> str:
    """What ``dataset`` leaves out, in words (``data.usable.left_out_text``; ``unusable``:
    samples whose text does not go with their images); a ``UsageError`` when that is
    everything: a source with nothing to read is an error, not an empty table."""
    from dtdsl.data.usable import NO_LAYOUT, left_out_text
    from dtdsl.driver import UsageError

    told = left_out_text(dataset, {NO_LAYOUT: unusable} if unusable else None)
    if len(dataset) <= unusable:
        raise UsageError(f"{source} has no sample to read: " + (told or "it is empty"))
    return told


def _tokenizer(args: argparse.Namespace, program: Program | None):
    """The tokenizer to count text with: ``--tokenizer``, else the spec's; None: words."""
    from dtdsl.data.text import HFTokenizer

    if getattr(args, "tokenizer", None):
        return HFTokenizer.load(args.tokenizer, args.chat)
    if program is not None and program.data.tokenizer is not None:
        return HFTokenizer.load(program.data.tokenizer, program.data.chat)
    return None


def _open(source: str, program: Program | None, *, rebuild: bool = False,
          image_folder: str | None = None):
    """A dataset, WebDataset shards or a LLaVA JSON, indexed with a progress bar on stderr
    when needed."""
    from dtdsl.data.sources import open_dataset
    from dtdsl.driver import UsageError
    from dtdsl.report import progress_bar

    if source.endswith(".dt") and Path(source).is_file():
        raise UsageError(f"{source} is a spec, not a dataset: give the dataset as SOURCE "
                         "(and the spec with --spec, for `data stats`)")
    with progress_bar(f"indexing {source}", enabled=sys.stderr.isatty()) as bar:
        return open_dataset(source, program=program, rebuild=rebuild,
                            image_folder=image_folder,
                            progress=lambda done, total: bar(done, total, "parts"))


def _cmd_index(args: argparse.Namespace) -> int:

    start = time.perf_counter()
    tokenizer = _tokenizer(args, None)
    with _open(args.source, None, rebuild=args.rebuild,
               image_folder=args.image_folder) as dataset:
        index = getattr(dataset, "index", None)
        where = getattr(index, "cached", None) if hasattr(index, "cached") else \
            getattr(index, "path", None)
        unusable = 0
        if tokenizer is not None:
            from dtdsl.data.text import token_layouts

            layouts = token_layouts(dataset, tokenizer)
            unusable = sum(lay is None for lay in layouts)
        line = (f"{args.source}: {len(dataset):,} samples in {len(dataset.shard_names)} "
                f"shards")
        told = _left_out(args.source, dataset, unusable)
    if told:
        line += "; " + told
    line += f"; index {where}" if where else " (a dtdsl dataset: its own index)"
    if tokenizer is not None:
        line += f"; token counts of {tokenizer.path}"
    print(f"{line} ({time.perf_counter() - start:.1f} s)", file=sys.stderr)
    return EXIT_OK


def _text_options(parser: argparse.ArgumentParser, *, spec: bool) -> None:
    parser.add_argument("--tokenizer", metavar="PATH",
                        help="count text tokens with this tokenizer.json (or a Hugging Face "
                        "folder holding one); default: " + ("the spec's (--spec), else "
                                                            if spec else "") +
                        "words and marks")
    parser.add_argument("--chat", choices=("chatml", "llama3", "llava"),
                        help="the chat format of conversations (default: the tokenizer's)")
    parser.add_argument("--image-folder", metavar="DIR",
                        help="where a LLaVA JSON's image paths start (default: its folder)")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``data`` (with ``synth``, ``stats`` and ``index``) to dtc's subcommands."""
    from dtdsl.data.shards import DEFAULT_SAMPLES_PER_SHARD

    data = subparsers.add_parser("data", help="synthesise a dataset that follows a spec, "
                                 "measure a dataset's distribution")
    sub = data.add_subparsers(dest="data_command", metavar="COMMAND", required=True)

    synth = sub.add_parser("synth", help="write synthetic samples that follow the spec's data "
                           "block as tar shards")
    synth.add_argument("spec", metavar="SPEC", help="spec file ('-' for stdin)")
    synth.add_argument("-o", "--output", metavar="DIR",
                       help="output directory (default: the spec's data.source, relative to "
                       "the spec's folder)")
    synth.add_argument("--samples", type=positive_int, metavar="N",
                       help="how many samples (default: data.samples, else 4 x global_batch "
                       f"x steps, at most {DEFAULT_MAX_SAMPLES})")
    synth.add_argument("--seed", type=int, metavar="S",
                       help="random seed (default: the spec's train.seed)")
    synth.add_argument("--shard-size", type=positive_int, metavar="N",
                       default=DEFAULT_SAMPLES_PER_SHARD,
                       help=f"samples per shard (default {DEFAULT_SAMPLES_PER_SHARD})")
    synth.add_argument("--overwrite", action="store_true",
                       help="replace the dataset in a non-empty output directory")
    synth.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")
    synth.set_defaults(func=_cmd_synth)

    stats = sub.add_parser("stats", help="measure a dataset's distribution from its index: a "
                           "table, or JSON a spec can read with empirical(...)")
    stats.add_argument("dataset", metavar="SOURCE", help="a dataset directory (with "
                       "index.json), WebDataset shards (a folder, a brace pattern, a .tar) or "
                       "a LLaVA-style .json/.jsonl")
    how = stats.add_mutually_exclusive_group()
    how.add_argument("--spec", metavar="SPEC",
                     help="count image patches with this spec's image encoder (its patch, "
                     "and the clamp of image.patches), audio and video tokens with its audio "
                     "and video encoders")
    how.add_argument("--patch", type=positive_int, metavar="PX",
                     help="patch size in pixels for image.patches (default 14)")
    _text_options(stats, spec=True)
    stats.add_argument("--json", action="store_true",
                       help='print {"quantity": [values...]} instead of the table')
    stats.add_argument("-o", "--output", metavar="FILE",
                       help="also write that JSON here (for empirical(\"FILE\"))")
    stats.set_defaults(func=_cmd_stats)

    index = sub.add_parser("index", help="index WebDataset shards for random access (once: "
                           "kept in .dtdsl-index/ beside them, or the user's cache)")
    index.add_argument("source", metavar="SOURCE", help="WebDataset shards (a folder, a brace "
                       "pattern such as 'shards/{000000..000099}.tar', a .tar) or a LLaVA-style "
                       ".json/.jsonl")
    index.add_argument("--rebuild", action="store_true",
                       help="read every shard again even if an index of them exists")
    _text_options(index, spec=False)
    index.set_defaults(func=_cmd_index)
