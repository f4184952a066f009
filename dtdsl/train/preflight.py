"""What a launch checks before torchrun starts a rank: one clear line per problem, not a
traceback per rank per restart.

``python -m dtdsl.train.preflight BUNDLE [--run-dir DIR] [--data SOURCE]`` (``launch.sh``
runs it on every node) checks that the bundle's data can be read (and indexes WebDataset
shards once, before the workers and trainers open them), that the job key of the
preprocessing transport is readable and private to its owner, that the newest complete
checkpoint in the run directory (the one a resumed run loads) was written for this
bundle's spec, and that every ``pretrained``
directory the bundle's program names is still there, still holds the model the bundle
was compiled against (its ``config.json`` has the same sha256) and still has every tensor
in its shape, floating point, in files whose headers agree with the files (the
safetensors headers, nothing more is read). A run directory with a
complete checkpoint needs no pretrained weights: a resumed run takes every parameter from
its checkpoint; a generator's VAE (frozen, never checkpointed) is checked the same way
in every case. Exit status 0, or 2 with the problems on stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from dtdsl.ir import program as ir

__all__ = ["check_data", "check_key", "check_pretrained", "check_resume", "check_vaes", "main"]


def check_pretrained(program: ir.Program) -> list[str]:
    """Problems with the program's pretrained weights (empty: all there and fitting)."""
    problems: list[str] = []
    for module in program.modules:
        if module.pretrained is None:
            continue
        # Imported here: a bundle without pretrained weights starts without torch.
        from dtdsl.models.hf import HFError, pretrained_problems, read_hf

        where = f"{module.role} {module.name}: pretrained {module.pretrained}"
        try:
            found = read_hf(module.pretrained, role=module.role)
            if module.hf is not None and Path(module.hf.path) == found.weights_dir and \
                    found.source.config_sha256 != module.hf.config_sha256:
                problems.append(f"{where}: its config.json changed since the bundle was "
                                "compiled; compile again")
                continue
            # Every file's header, checked against the file (its size, its tensors'
            # spans and types), and every tensor the module reads, in its shape.
            wrong = pretrained_problems(found, module.role, module.arch)
            if wrong:
                problems.append(f"{where}: {wrong[0]}" + (f" (and {len(wrong) - 1} more)"
                                                        if len(wrong) > 1 else ""))
        except HFError as err:
            problems.append(f"{where}: {err.message}" + (f"; {err.hint}" if err.hint else ""))
    return problems


def check_vaes(program: ir.Program) -> list[str]:
    """Problems with the VAE folders the generators read (their safetensors headers):
    frozen, never in a run's checkpoint, so needed by a resumed run too."""
    problems: list[str] = []
    for module in program.modules:
        if module.vae is None:
            continue
        from dtdsl.models.hf import HFError
        from dtdsl.models.vae import VAEConfig, VAEError, vae_problems

        where = f"{module.role} {module.name}: vae {module.vae.path}"
        try:
            wrong = vae_problems(VAEConfig.of(module.vae))
            if wrong:
                problems.append(f"{where}: {wrong[0]}")
        except (HFError, VAEError) as err:
            message = err.message if isinstance(err, HFError) else str(err)
            hint = err.hint if isinstance(err, HFError) else None
            problems.append(f"{where}: {message}" + (f"; {hint}" if hint else ""))
    return problems


def check_data(program: ir.Program, source: str) -> list[str]:
    """Problems with the bundle's data (empty: readable). WebDataset shards and LLaVA
    JSON are indexed here, and their text's tokens counted with the spec's tokenizer, once,
    before any worker or trainer opens them."""
    from dtdsl.data.shards import DatasetError
    from dtdsl.data.sources import source_problem
    from dtdsl.data.text import TokenizerError
    from dtdsl.feed.source import DatasetSource

    problem = source_problem(source)
    if problem is not None:
        return [f"data {source}: {problem}"]
    try:
        found = DatasetSource(program, source, progress=lambda done, total: print(
            f"launch.sh: indexing {source}: {done}/{total}", file=sys.stderr,
            flush=True) if done in (1, total) else None)
        found.dataset.close()
    except (DatasetError, TokenizerError) as err:
        return [f"data {source}: {err}"]
    return []


def check_key(bundle: Path, job: Any) -> list[str]:
    """Problems with the job key (empty: readable, private, well-formed): every worker
    and trainer reads it, and a restart would not change it."""
    if job.feed.workers == 0:
        return []
    from dtdsl.feed.wire import read_secret

    path = bundle / job.secret_file
    try:
        read_secret(path)
    except PermissionError as err:
        return [str(err)]
    except OSError as err:
        return [f"cannot read the job key {path}: {err.strerror or err}; compile the "
                "bundle again"]
    except ValueError as err:
        return [f"the job key {path}: {err}; compile the bundle again"]
    return []


def check_plan(bundle: Path, job: Any, program: ir.Program) -> list[str]:
    """Problems with the bundle's plan (``ir.plan_check``, as ``dtc`` checks a plan it is
    given) and the job's world (its ranks, the plan's): an edited bundle stops here, in
    one line each, not on every rank at every restart."""
    from pydantic import ValidationError

    from dtdsl.errors import validation_problems
    from dtdsl.ir.plan import Plan
    from dtdsl.ir.plan_check import MAX_PLAN_BYTES, plan_problems
    from dtdsl.outdir import read_bounded

    path = bundle / job.plan_file
    try:
        data = read_bounded(path, MAX_PLAN_BYTES)
        if len(data) > MAX_PLAN_BYTES:
            return [f"{path} is more than {MAX_PLAN_BYTES >> 20} MiB, which no plan is; "
                    "compile the bundle again"]
        plan = Plan.model_validate_json(data)
    except OSError as err:
        return [f"cannot read {path}: {err.strerror or err}; compile the bundle again"]
    except ValidationError as err:
        return [f"{path} is not a plan: {validation_problems(err)}; compile the bundle again"]
    except ValueError as err:       # not a regular file
        return [f"{err}; compile the bundle again"]
    if sorted(u.name for u in plan.units) != sorted(m.name for m in program.modules):
        return [f"{path} does not plan the units of {job.program_file}; compile the bundle "
                "again"]
    problems = [f"{path}: {p}" for p in plan_problems(plan, program)]
    if job.world_size != plan.gpus_used:
        problems.append(f"job.json's world_size {job.world_size} is not the plan's "
                        f"{plan.gpus_used} GPUs")
    if job.launched < job.world_size:
        problems.append(f"job.json's {job.nodes} nodes of {job.gpus_per_node} GPUs cannot "
                        f"hold its world_size {job.world_size}")
    return [f"{p}; compile the bundle again" for p in problems[:5]] if problems else []


def check_resume(job: Any, run_dir: str | Path) -> list[str]:
    """Problems with the checkpoint a resumed run would load (the newest complete one):
    it must be of this bundle's spec (another plan is resharded, another spec is not), its
    files whole (``dcp_safe.read_metadata``), and no newer ``ckpt-<N>`` damaged."""
    from dtdsl.ir.checkpoint import (
        CheckpointError,
        checkpoint_root,
        complete_checkpoints,
        damaged_checkpoints,
        read_manifest,
        same_spec,
    )

    done = complete_checkpoints(run_dir)
    damaged = damaged_checkpoints(run_dir)
    if damaged:
        path, why = damaged[-1]
        then = f"resume from {done[-1][1].name}" if done else "start over"
        return [f"{path} is not a complete checkpoint ({why}); move it out of "
                f"{checkpoint_root(run_dir)} to {then}"]
    if not done:
        return []
    # Imported here: DCP's metadata classes import torch, which a first run's check needs
    # nowhere else.
    from dtdsl.train.dcp_safe import UnsafeMetadata, read_metadata

    path = done[-1][1]
    try:
        manifest = read_manifest(path)
    except CheckpointError as err:
        return [str(err)]
    if not same_spec(manifest, job.spec_sha256, job.program_sha256):
        return [f"{path} was written for spec {manifest.spec} (sha256 "
                f"{manifest.spec_sha256[:12]}...) but this bundle is of spec {job.spec} "
                f"(sha256 {job.spec_sha256[:12]}...): resume it with the bundle it was "
                "trained with, or choose another --run-dir"]
    try:
        read_metadata(path)     # its files there, whole, regular: no restart loop on them
    except UnsafeMetadata as err:
        then = (f"resume from {done[-2][1].name}" if len(done) > 1 else "start over")
        return [f"cannot load {path}: {err}; move it out of {checkpoint_root(run_dir)} "
                f"to {then}"]
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtdsl.train.preflight",
                                     description="check a bundle's inputs before a launch")
    parser.add_argument("bundle", help="the bundle directory")
    parser.add_argument("--run-dir", help="the run directory (a checkpoint there: resuming)")
    parser.add_argument("--data", help="the data the launch reads instead of the bundle's")
    args = parser.parse_args(argv)
    from dtdsl.ir.checkpoint import complete_checkpoints
    from dtdsl.ir.job import load_job

    bundle = Path(args.bundle)
    try:
        job = load_job(bundle)
    except ValueError as err:
        print(f"launch.sh: {err}", file=sys.stderr)
        return 2
    from dtdsl.outdir import read_bounded

    try:
        # A regular file (a FIFO would hang every launch here); a program holds at most a
        # few empirical distributions of MAX_EMPIRICAL_VALUES values: far below 1 GiB.
        program = ir.Program.model_validate_json(read_bounded(bundle / job.program_file,
                                                              1 << 30))
    except (OSError, ValueError) as err:
        why = err.strerror if isinstance(err, OSError) else "not a program"
        print(f"launch.sh: cannot read {bundle / job.program_file}: {why}; compile the "
              "bundle again", file=sys.stderr)
        return 2
    problems = check_plan(bundle, job, program)
    if problems:        # nothing else of the bundle is to be trusted
        for line in problems:
            print(f"launch.sh: {line}", file=sys.stderr)
        return 2
    if args.data is not None or job.data.kind == "dataset":
        source = args.data if args.data is not None else str(bundle / str(job.data.path))
        problems += check_data(program, source)
    problems += check_key(bundle, job)
    if args.run_dir is not None:
        problems += check_resume(job, args.run_dir)
    if args.run_dir is None or not complete_checkpoints(args.run_dir):
        problems += check_pretrained(program)
    problems += check_vaes(program)
    for line in problems:
        print(f"launch.sh: {line}", file=sys.stderr)
    return 2 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
