"""A launch bundle's job description (``job.json``): what every generated program reads.

``dtc compile`` writes it next to ``program.json`` (the checked spec), ``plan.json`` and
``schedule.txt``; the rank programs, the preprocessing workers and ``launch.sh`` read it.
It holds no absolute path and nothing that changes between two compiles of one spec: the
per-job secret of the preprocessing transport is a separate file (``job.key``).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["JOB_VERSION", "CheckpointConfig", "CostConfig", "DataConfig", "FeedConfig", "Job",
           "RankEntry", "RankProgram", "fault_point", "load_job"]

JOB_VERSION = 1


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class DataConfig(_Model):
    """Where the samples come from: a dataset (written by ``dtc data synth``, or WebDataset
    shards: ``data.sources``), or samples drawn from the spec's distributions."""

    kind: Literal["dataset", "synthetic"]
    # The dataset, relative to the bundle unless absolute: a folder, a .tar, or a brace
    # pattern of shards.
    path: str | None = None


class FeedConfig(_Model):
    """The preprocessing workers and their transport."""

    workers: int = Field(ge=0)     # 0: every trainer builds its own batches in-process
    prefetch: int = Field(ge=1)    # steps a worker may run ahead of the trainers
    hosts: tuple[str, ...]         # per node: the address its trainers bind to
    port_base: int = Field(ge=1024, le=65000)   # trainer rank r listens on port_base + 1 + r
    max_message_bytes: int = Field(ge=1)

    def trainer_address(self, rank: int, gpus_per_node: int, port_base: int | None = None
                        ) -> str:
        base = self.port_base if port_base is None else port_base
        return f"tcp://{self.hosts[rank // gpus_per_node]}:{base + 1 + rank}"

    def control_address(self, port_base: int | None = None) -> str:
        """Trainer rank 0 publishes the training progress here (on node 0)."""
        base = self.port_base if port_base is None else port_base
        return f"tcp://{self.hosts[0]}:{base}"


class CostConfig(_Model):
    """The cost model the plan was made with, so the run's predictions (TensorBoard's
    ``predicted/``) price its batches the same way: the analytic model's efficiencies, or
    the measured profile (``dtc compile --profile``, copied into the bundle)."""

    matmul: float = Field(default=0.70, gt=0, le=1)
    attention: float = Field(default=0.50, gt=0, le=1)
    conv: float = Field(default=0.45, gt=0, le=1)
    profile_file: str | None = None

    def cost_model(self, program: Any, bundle: str | Path) -> Any:
        """The plan's cost model for ``program`` (a ``cost.model.CostModel``)."""
        from dtdsl.cost.model import CostParams, Efficiency, build_cost_model
        from dtdsl.cost.profile import ProfileTable, load_profile

        params = CostParams(efficiency=Efficiency(matmul=self.matmul,
                                                  attention=self.attention, conv=self.conv))
        table = None
        if self.profile_file is not None:
            table = ProfileTable(load_profile(Path(bundle) / self.profile_file))
        return build_cost_model(program, params, profile=table)


class CheckpointConfig(_Model):
    every: int = Field(ge=0)       # steps between checkpoints (0: none)
    keep: int = Field(ge=1)        # the newest this many are kept


class Job(_Model):
    """``job.json``."""

    version: Literal[1] = JOB_VERSION
    spec: str                      # the spec's name
    spec_sha256: str
    world_size: int = Field(ge=1)
    nodes: int = Field(ge=1)
    gpus_per_node: int = Field(ge=1)
    steps: int = Field(ge=1)
    reorder: tuple[Literal["intra", "inter"], ...]
    data: DataConfig
    feed: FeedConfig
    checkpoint: CheckpointConfig
    cost: CostConfig = Field(default_factory=CostConfig)
    program_file: str = "program.json"
    plan_file: str = "plan.json"
    schedule_file: str = "schedule.txt"
    secret_file: str = "job.key"


def load_job(bundle: str | Path) -> Job:
    """``bundle/job.json``; ValueError naming the file when it is missing or invalid."""
    path = Path(bundle) / "job.json"
    try:
        return Job.model_validate_json(path.read_bytes())
    except OSError as err:
        raise ValueError(f"cannot read {path}: {err.strerror or err}") from None
    except ValueError as err:
        raise ValueError(f"{path} is not a valid job description: {err}") from None


@dataclass(frozen=True)
class RankEntry:
    """One global rank of a rank program: its coordinates and the ranks of its groups."""

    replica: int
    tp_index: int
    tp_group: tuple[int, ...]
    dp_group: tuple[int, ...]
    pp_group: tuple[int, ...]


@dataclass(frozen=True)
class RankProgram:
    """A pipeline stage of one unit, as a generated rank program states it."""

    unit: str
    role: str
    stage: int
    layers: tuple[int, int]                 # [first, last) of the unit's layers
    tp: int
    dp: int
    pp: int
    ranks: Mapping[int, RankEntry]          # global rank -> its entry
    schedule: tuple[str, ...]               # the stage's actions, text form


def fault_point(who: str, step: int, run_dir: Path) -> None:
    """SIGKILL this process when ``DTDSL_FAULT`` names ``who`` at ``step`` (once per
    run directory: a marker file records that it happened)."""
    spec = os.environ.get("DTDSL_FAULT", "")
    for item in filter(None, (s.strip() for s in spec.split(","))):
        target, _, at = item.partition("@")
        if target != who or not at.isdigit() or int(at) != step:
            continue
        marker = run_dir / "faults" / f"{who}@{step}"
        marker.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return
        os.close(fd)
        print(f"DTDSL_FAULT: killing {who} at step {step}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
