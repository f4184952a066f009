"""``dtc export``: a run's checkpoint as Hugging Face directories, one per unit.

A checkpoint (``train.checkpoint``) is a DCP state dict of every unit's parameters under
their plan-independent names, with the ``program.json`` it was trained from. Export reads
it in one process, no process group, whatever plan wrote it (DCP reassembles the shards),
and writes each module as ``OUT/<module>/``:

- the backbone, a vision tower, a U-Net: a Hugging Face directory (``config.json`` and
  safetensors, sharded at 5 GiB with an index; a U-Net's ``scheduler_config.json``) that
  ``transformers`` / ``diffusers`` ``from_pretrained`` load (``models.hf.export_module``). A
  module read from a Hugging Face directory keeps that config, with the architecture's
  values written over it; a vision tower read below its top layer from pretrained weights
  is written whole, its untrained top taken from those weights;
- a module no Hugging Face class computes (dtdsl's own ViT, a DiT) and every projector:
  ``model.safetensors`` under dtdsl's parameter names and ``dtdsl.json`` (the
  architecture), so nothing trained is lost.

Tensors are read a batch at a time (at most ``BATCH_BYTES``) and written shard by shard:
memory holds about one shard, not the model.

Each unit's folder records its files with their sha256 (``dtdsl-manifest.json``). Every
unit is written into a new folder beside its target and the folders are swapped in once
all are written, so an error or a refusal leaves ``OUT`` as it was. An earlier export's
unit folder is replaced only when it holds exactly what its record lists, unchanged; a
symbolic link (``OUT``, a unit folder, a file), a file or folder no record lists, someone
else's model there, is refused (ExportError) before anything is written.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import ValidationError
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dtdsl.errors import validation_problems
from dtdsl.ir import program as ir
from dtdsl.ir.checkpoint import (
    PROGRAM,
    CheckpointError,
    complete_checkpoints,
    damaged_checkpoints,
    program_sha256,
    read_manifest,
    same_spec,
)
from dtdsl.outdir import (
    OutputError,
    Snapshot,
    Staged,
    read_record,
    real_dir,
    stage,
    verify_recorded,
    write_record,
)
from dtdsl.train.dcp_safe import SafeLoadPlanner, SafeReader, UnsafeMetadata, read_metadata

__all__ = ["BATCH_BYTES", "ExportError", "ExportedUnit", "export_checkpoint",
           "find_checkpoint"]

BATCH_BYTES = 1 << 30
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ExportError(CheckpointError):
    """The output folder cannot take the export (the message names what is there); ``dtc
    export`` reports it as it reports a checkpoint it cannot use."""


@dataclass(frozen=True)
class ExportedUnit:
    name: str
    directory: Path
    hf: bool                 # a Hugging Face model (else dtdsl's own safetensors)
    note: str = ""           # why not, for one that is not


def find_checkpoint(path: str | Path, step: int | None = None) -> Path:
    """The checkpoint directory: ``path`` itself when it is one, else the run directory's
    newest complete checkpoint (or the one after ``step`` steps)."""
    path = Path(path)
    if (path / ".metadata").is_file() and (path / "manifest.json").is_file():
        if step is not None and read_manifest(path).step != step:
            raise CheckpointError(f"{path} holds step {read_manifest(path).step}, not {step}")
        return path
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a run directory or a checkpoint")
    done = complete_checkpoints(path)
    damaged = damaged_checkpoints(path) if step is None else []
    if damaged:
        raise CheckpointError(f"the newest checkpoint, {damaged[-1][0]}, is not complete "
                              f"({damaged[-1][1]}); name an older one with --step" +
                              (f" (the newest complete: --step {done[-1][0]})" if done else ""))
    if not done:
        # A bundle's folder for its run's (launch.sh's default run directory).
        bundle = (path / "job.json").is_file() and (path / "run").is_dir()
        raise CheckpointError(f"{path} has no complete checkpoint (looked in "
                              f"{path / 'checkpoints'})" +
                              (f"; it is a bundle: its run is {path / 'run'}" if bundle
                               else ""))
    if step is None:
        return done[-1][1]
    for n, found in done:
        if n == step:
            return found
    raise CheckpointError(f"{path} has no checkpoint after {step} steps; it has "
                          + ", ".join(str(n) for n, _ in done))


class _Reader:
    """Full tensors of a DCP checkpoint by name, loaded in batches in the order asked."""

    def __init__(self, path: Path, order: Sequence[str], shapes: dict[str, tuple]):
        import torch.distributed.checkpoint as dcp

        self._dcp = dcp
        self.path, self.order, self.shapes = path, list(order), shapes
        self._cache: dict[str, torch.Tensor] = {}

    def get(self, key: str) -> torch.Tensor:
        if key not in self._cache:
            self._cache.clear()
            start = self.order.index(key)
            batch, size = {}, 0
            for name in self.order[start:]:
                shape, dtype = self.shapes[name]
                nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
                if batch and size + nbytes > BATCH_BYTES:
                    break
                batch[name] = torch.empty(shape, dtype=dtype)
                size += nbytes
            with warnings.catch_warnings():     # DCP's note that it loads in one process
                warnings.filterwarnings("ignore", message=".*single process")
                try:
                    self._dcp.load(batch, storage_reader=SafeReader(self.path),
                                   planner=SafeLoadPlanner(), no_dist=True)
                except (Exception, CheckpointException) as err:
                    raise CheckpointError(f"cannot read {self.path}: {_why(err)}") from None
            self._cache.update(batch)
        return self._cache.pop(key)


def _why(err: BaseException) -> str:
    """An error of DCP's reading in one line (a CheckpointException's first failure)."""
    failures = getattr(err, "failures", None)
    if failures:
        err = next(iter(failures.values()))[0]
    line = (str(err).strip().splitlines() or [""])[-1]
    return f"{type(err).__name__}: {line[:300]}"


def _program(ckpt: Path, spec_program: ir.Program | None) -> ir.Program:
    manifest = read_manifest(ckpt)
    if spec_program is not None:
        if not same_spec(manifest, spec_program.source_sha256, program_sha256(spec_program)):
            raise CheckpointError(f"{ckpt} was trained from another spec (sha256 "
                                  f"{manifest.spec_sha256[:12]}...)")
        return spec_program
    try:
        return ir.Program.model_validate_json((ckpt / PROGRAM).read_bytes())
    except OSError:
        raise CheckpointError(f"{ckpt} has no {PROGRAM} (written before dtdsl kept it): "
                              "give the spec it was trained from with --spec") from None
    except ValidationError as err:
        raise CheckpointError(f"{ckpt / PROGRAM} is not a program: "
                              f"{validation_problems(err)}") from None
    except ValueError as err:
        raise CheckpointError(f"{ckpt / PROGRAM} is not a program: {err}") from None


def export_checkpoint(path: str | Path, out: str | Path, *, step: int | None = None,
                      dtype: str | None = None, units: Sequence[str] | None = None,
                      program: ir.Program | None = None,
                      log: Callable[[str], None] = lambda _: None) -> list[ExportedUnit]:
    """Export the checkpoint at ``path`` (a run directory, newest or ``step``; or a
    checkpoint directory) into ``out`` (module docstring). ``dtype``: ``fp32``, ``bf16`` or
    ``fp16`` (default: as trained, fp32 master weights); ``units``: only these;
    ``program``: the spec's program when the checkpoint has none. ExportError, before
    anything is written, for an ``out`` that cannot take the export (``_verify_out``)."""

    ckpt = find_checkpoint(path, step)
    prog = _program(ckpt, program)
    log(f"reading {ckpt} (after step {read_manifest(ckpt).step})")
    try:
        metadata = read_metadata(ckpt).state_dict_metadata
    except UnsafeMetadata as err:
        raise CheckpointError(str(err)) from None
    names = [m.name for m in prog.modules] + [p.name for p in prog.projectors]
    if units is not None:
        unknown = sorted(set(units) - set(names))
        if unknown:
            raise CheckpointError(f"no unit {', '.join(unknown)} in the checkpoint; it has "
                                  + ", ".join(names))
        names = [n for n in names if n in units]
    cast = _DTYPES[dtype] if dtype is not None else None
    shapes = {}
    for name in names:
        prefix = f"model.units.{name}."
        entries = {k[len(prefix):]: v for k, v in metadata.items() if k.startswith(prefix)}
        odd = next((k for k, v in entries.items() if not isinstance(v, TensorStorageMetadata)),
                   None)
        if odd is not None:
            raise CheckpointError(f"{ckpt}: {prefix}{odd} is not a tensor")
        shapes[name] = {k: (tuple(v.size), v.properties.dtype) for k, v in entries.items()}
        if not shapes[name]:
            raise CheckpointError(f"{ckpt} holds no parameters of {name}")
    out = Path(out)
    made = _missing_folders(out)
    try:
        snapshots = _verify_out(out, names)
        staged: list[Staged] = []
        try:
            done = []
            for name in names:
                staged.append(stage(out / name, snapshots[name]))
                done.append(_export_unit(staged[-1].path, out / name, name, prog, ckpt,
                                         shapes[name], cast, log))
                write_record(staged[-1].path)
            for s in staged:          # every unit written and its old folder unchanged
                s.snapshot.recheck()
            for s in staged:
                s.commit()
        except BaseException:
            for s in staged:
                s.discard()
            for folder in made:     # the folders this export made, if still empty: gone
                with contextlib.suppress(OSError):
                    folder.rmdir()
            raise
    except OutputError as err:
        raise ExportError(str(err)) from None
    return done


def _missing_folders(path: Path) -> list[Path]:
    """``path`` and each of its parents that does not exist yet, deepest first."""
    missing = []
    path = Path(os.path.abspath(path))
    while not os.path.lexists(path) and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


_LEFT = re.compile(r"\..*\.dtdsl-(new|old)-[^/]*\Z", re.DOTALL)   # outdir.stage's folders


def _verify_out(out: Path, names: Sequence[str]) -> dict[str, Snapshot]:
    """That ``out`` may take the units ``names``: not a symbolic link; each unit's folder
    new, empty or one an export wrote, unchanged (``outdir.verify_recorded``); anything
    else in ``out`` (a file, a link, someone's folder) is refused. Other units' folders of
    an earlier export stay."""
    if real_dir(out):
        for entry in sorted(out.iterdir()):
            if entry.name in names:
                continue
            if _LEFT.match(entry.name):
                raise OutputError(f"{out} holds {entry.name}, left by an export that was "
                                  "interrupted (or one still running): when none runs, "
                                  "remove it and export again")
            if entry.is_symlink() or not entry.is_dir() or read_record(entry) is None:
                raise OutputError(f"{out} holds {entry.name}, which dtdsl did not export; "
                                  "nothing was changed: move it away, or export into "
                                  "another folder")
    return {name: verify_recorded(out / name) for name in names}


def _export_unit(folder: Path, target: Path, name: str, prog: ir.Program, ckpt: Path,
                 shapes: dict[str, tuple], cast: torch.dtype | None,
                 log: Callable[[str], None]) -> ExportedUnit:
    """Unit ``name`` into the new ``folder`` (to become ``target``)."""
    from dtdsl.models.hf import HFError, export_module

    prefix = f"model.units.{name}."
    reader = _Reader(ckpt, [prefix + k for k in shapes],
                     {prefix + k: v for k, v in shapes.items()})

    def get(key: str) -> torch.Tensor:
        return reader.get(prefix + key)

    spec = next((m for m in prog.modules if m.name == name), None)
    if spec is not None and not isinstance(spec.arch, ir.DiTArch):
        try:
            export_module(folder, arch=spec.arch, role=spec.role, source=spec.hf,
                          shapes=shapes, get=get, pretrained=spec.pretrained, dtype=cast)
            log(f"{name}: {target} (Hugging Face {spec.hf.family if spec.hf else 'model'})")
            return ExportedUnit(name, target, hf=True)
        except HFError as err:
            note = err.message
        for path in list(folder.iterdir()):    # what it wrote before it gave up
            path.unlink()
    else:
        note = "a projector" if spec is None else "a DiT has no Hugging Face class here"
    _write_own(folder, name, spec, prog, shapes, get, cast)
    log(f"{name}: {target} (dtdsl's names: {note})")
    return ExportedUnit(name, target, hf=False, note=note)
def _write_own(target: Path, name: str, spec: ir.Module | None, prog: ir.Program,
               shapes: dict[str, tuple], get: Callable[[str], torch.Tensor],
               cast: torch.dtype | None) -> None:
    """A unit under dtdsl's own names, with its architecture beside it."""
    from dtdsl.models.hf.weights import HFTensor, write_checkpoint

    arch = spec.arch if spec is not None else next(p for p in prog.projectors
                                                    if p.name == name).arch
    tensors = []
    for key, (shape, dtype) in shapes.items():
        numel = int(torch.Size(shape).numel())

        def make(key: str = key) -> torch.Tensor:
            t = get(key)
            return t.to(cast) if cast is not None else t

        tensors.append(HFTensor(key, numel * (cast or dtype).itemsize, make))
    target.mkdir(parents=True, exist_ok=True)
    about = {"unit": name, "role": spec.role if spec is not None else "projector",
             "arch": arch.model_dump(mode="json")}
    with open(target / "dtdsl.json", "x", encoding="utf-8") as f:   # a new folder's
        f.write(json.dumps(about, indent=2, sort_keys=True) + "\n")
    write_checkpoint(target, tensors, library="transformers")
