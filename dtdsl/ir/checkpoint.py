"""A checkpoint's files and manifest (``train.checkpoint`` writes and loads them): where a
run's checkpoints live, ``manifest.json``'s schema, and which checkpoints are complete.
Torch-free: the preprocessing workers and ``dtc`` read them too."""

from __future__ import annotations

import base64
import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from dtdsl.errors import DtdslError, validation_problems
from dtdsl.ir.bounds import MAX_CLUSTER_GPUS
from dtdsl.outdir import read_bounded

__all__ = ["FORMAT", "MANIFEST", "MODES", "PROGRAM", "VERSION", "CheckpointError",
           "CheckpointMismatch", "Manifest", "UnitLayout", "checkpoint_root",
           "complete_checkpoints", "damaged_checkpoints", "latest_checkpoint",
           "program_sha256", "read_manifest", "same_spec"]

FORMAT = "dtdsl-checkpoint"
VERSION = 1
MODES = ("sync", "thread")
MANIFEST = "manifest.json"
PROGRAM = "program.json"    # the checked spec it was trained from (``dtc export`` reads it)
_NAME = re.compile(r"ckpt-(\d+)\Z")


class CheckpointError(DtdslError, RuntimeError):
    """A checkpoint that cannot be used here (another spec, missing tensors, bad files)."""


class CheckpointMismatch(CheckpointError):
    """A checkpoint this job can never load (another spec, metadata that is not DCP's):
    no restart changes it (``feed.faults`` ends the launch with its message)."""


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class UnitLayout(_Model):
    name: str
    tp: int = Field(ge=1, le=MAX_CLUSTER_GPUS)
    dp: int = Field(ge=1, le=MAX_CLUSTER_GPUS)
    pp: int = Field(ge=1, le=MAX_CLUSTER_GPUS)
    colocated: bool = False     # ran on the backbone's stages (written since issue 27)
    phased: bool = False        # ran phased on the backbone's ranks (likewise)
    cp: int = Field(default=1, ge=1, le=MAX_CLUSTER_GPUS)   # context parallelism (issue 30)
    vpp: int = Field(default=1, ge=1, le=MAX_CLUSTER_GPUS)  # model chunks per stage

    @property
    def text(self) -> str:
        """``vit:tp1dp2pp1`` (``llm:tp1dp1pp2vpp2`` interleaved), or ``vit:colocated``
        (``vit:phased``) for a unit that ran on its host's stages (phased on the
        backbone's ranks)."""
        if self.colocated or self.phased:
            return f"{self.name}:{'colocated' if self.colocated else 'phased'}"
        cp = f"cp{self.cp}" if self.cp > 1 else ""
        vpp = f"vpp{self.vpp}" if self.vpp > 1 else ""
        return f"{self.name}:tp{self.tp}{cp}dp{self.dp}pp{self.pp}{vpp}"


class Manifest(_Model):
    """``manifest.json`` of one checkpoint (module docstring)."""

    format: Literal["dtdsl-checkpoint"] = FORMAT
    version: Literal[1] = VERSION
    step: int                       # steps done
    next_step: int                  # the data cursor: the step a resumed run starts with
    spec: str
    spec_sha256: str
    plan_sha256: str
    world_size: int = Field(ge=1, le=MAX_CLUSTER_GPUS)
    units: tuple[UnitLayout, ...]
    mode: Literal["sync", "thread"]
    num_tensors: int                # keys in the DCP checkpoint (the whole job's)
    rng_torch: str                  # base64 of torch.get_rng_state() on rank 0
    rng_cuda: str | None = None     # the same for the current CUDA device, if any
    program_sha256: str | None = None   # ``program_sha256`` (None: written before it was)

    @field_validator("rng_torch", "rng_cuda")
    @classmethod
    def _base64(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                base64.b64decode(value, validate=True)
            except ValueError:
                raise ValueError("not base64") from None
        return value

    @model_validator(mode="after")
    def _cursor_at_the_step(self) -> Manifest:
        # Every checkpoint is taken between steps: the data resumes where the weights are.
        if self.step < 0 or self.next_step != self.step:
            raise ValueError(f"step {self.step} and next_step {self.next_step} must be equal "
                             "and at least 0 (a checkpoint is taken between steps)")
        return self


def program_sha256(program: Any) -> str:
    """A digest of what a spec means: its checked program without the places in the text
    (spans), the file's name and the text's own digest, and without when and how many
    checkpoints are kept (``_NOT_TRAINING``). A comment, a reformatting (``dtc fmt``), a
    move or another ``checkpoint_every`` leave it as it was; any other setting changes it."""
    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items()
                    if k not in _TEXT_ONLY and k not in _NOT_TRAINING
                    and not k.endswith("_span")}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    body = json.dumps(strip(program.model_dump(mode="json")), sort_keys=True,
                      separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()


_TEXT_ONLY = frozenset({"span", "source_name", "source_sha256"})
# Settings of train that change no step's numbers: a resume may change them.
_NOT_TRAINING = frozenset({"checkpoint_every", "keep_checkpoints"})


def same_spec(manifest: Manifest, spec_sha256: str, program: str | None) -> bool:
    """Whether a checkpoint's spec is this job's: the same text, or (where both digests
    are known) the same program written differently."""
    return manifest.spec_sha256 == spec_sha256 or (
        program is not None and manifest.program_sha256 == program)


# ---- files ------------------------------------------------------------------------------

def checkpoint_root(run_dir: str | Path) -> Path:
    """Where a run's checkpoints live."""
    return Path(run_dir) / "checkpoints"


# A manifest lists a few fields per unit: kilobytes.
MAX_MANIFEST_BYTES = 1 << 20


def read_manifest(path: str | Path) -> Manifest:
    """The manifest of the checkpoint directory ``path``; CheckpointError when it is
    missing or invalid."""
    file = Path(path) / MANIFEST
    try:
        data = read_bounded(file, MAX_MANIFEST_BYTES)
        if len(data) > MAX_MANIFEST_BYTES:
            raise ValueError(f"more than {MAX_MANIFEST_BYTES >> 20} MiB, which no manifest is")
        return Manifest.model_validate_json(data)
    except OSError as err:
        raise CheckpointError(f"cannot read {file}: {err.strerror or err}") from None
    except ValidationError as err:
        raise CheckpointError(f"{file} is not a checkpoint manifest: "
                              f"{validation_problems(err)}") from None
    except ValueError as err:
        raise CheckpointError(f"{file} is not a checkpoint manifest: {err}") from None


def complete_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """The run's complete checkpoints as (steps done, directory), oldest first: directories
    ``ckpt-<N>`` (no ``.tmp``) with DCP's ``.metadata`` and a valid manifest for step N."""
    return [(n, path) for n, path, problem in _scan(run_dir) if problem is None]


def damaged_checkpoints(run_dir: str | Path) -> list[tuple[Path, str]]:
    """The ``ckpt-<N>`` directories newer than the newest complete checkpoint that are not
    complete, each with what is wrong. dtdsl renames a save into place only once it is
    whole, so one of these was damaged or edited since: resuming from an older one would
    silently go back, and write over it."""
    found = _scan(run_dir)
    newest = max((n for n, _, problem in found if problem is None), default=-1)
    return [(path, problem) for n, path, problem in found
            if problem is not None and n > newest]


def _scan(run_dir: str | Path) -> list[tuple[int, Path, str | None]]:
    """Every ``ckpt-<N>`` of the run as (N, path, why it is not a complete checkpoint or
    None), by N: one that is no directory (a file, a FIFO) is not one."""
    root = checkpoint_root(run_dir)
    try:
        entries = list(root.iterdir())
    except OSError:
        return []
    out: list[tuple[int, Path, str | None]] = []
    for path in entries:
        m = _NAME.match(path.name)
        if m is None:
            continue
        n = int(m.group(1))
        problem: str | None = None
        if not path.is_dir():
            problem = "it is not a directory"
        elif not (path / ".metadata").is_file():
            problem = "it has no DCP .metadata"
        else:
            try:
                step = read_manifest(path).step
                problem = None if step == n else f"its manifest says step {step}"
            except CheckpointError as err:
                problem = str(err)
        out.append((n, path, problem))
    return sorted(out, key=lambda e: e[0])


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of the run, or None."""
    done = complete_checkpoints(run_dir)
    return done[-1][1] if done else None
