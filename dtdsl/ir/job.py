"""A launch bundle's job description (``job.json``): what every generated program reads.

``dtc compile`` writes it next to ``program.json`` (the checked spec), ``plan.json`` and
``schedule.txt``; the rank programs, the preprocessing workers and ``launch.sh`` read it.
It holds no absolute path and nothing that changes between two compiles of one spec: the
per-job secret of the preprocessing transport is a separate file (``job.key``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from dtdsl.errors import validation_problems

__all__ = ["JOB_VERSION", "CheckpointConfig", "CostConfig", "DataConfig", "FeedConfig", "Job",
           "RankEntry", "RankProgram", "load_job"]

JOB_VERSION = 2


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def _in_bundle(name: str) -> str:
    """A file of the bundle, named relative to it: no absolute path, no '..' out of it."""
    path = Path(name)
    if not name or path.is_absolute() or ".." in path.parts:
        raise ValueError(f"{name!r} is not a file inside the bundle")
    return name


BundleFile = Annotated[str, AfterValidator(_in_bundle)]


class DataConfig(_Model):
    """Where the samples come from: a dataset (written by ``dtc data synth``, or WebDataset
    shards: ``data.sources``), or samples drawn from the spec's distributions."""

    kind: Literal["dataset", "synthetic"]
    # The dataset, relative to the bundle unless absolute: a folder, a .tar, or a brace
    # pattern of shards.
    path: str | None = None


class FeedConfig(_Model):
    """The preprocessing workers and their transport.

    Workers run on every node and serve that node's trainers only, over zmq ``ipc://``
    sockets in a node-local directory (``feed.node.feed_dir``: ``launch.sh`` makes one per node and
    exports it as ``DTDSL_FEED_DIR``). Nothing names a host: a node's trainers and workers
    find each other there, and the workers learn which global ranks the node holds from
    its first trainer's announcements, after torchrun's rendezvous has numbered the
    nodes. Each process opens a bounded number of sockets: a worker one per local trainer
    and one subscription, a trainer one inbox (and the node's first trainer one
    announcement socket), whatever the job's size."""

    workers: int = Field(ge=0)     # asked for (cluster.cpu_workers): 0 builds in-process
    workers_per_node: int = Field(ge=0)   # run on every node: ceil(workers / nodes)
    prefetch: int = Field(ge=1)    # steps a worker may run ahead of the trainers
    max_message_bytes: int = Field(ge=1)

    @staticmethod
    def trainer_address(feed_dir: str | Path, local_rank: int) -> str:
        """The inbox of the node's trainer ``local_rank``."""
        return f"ipc://{Path(feed_dir) / f'trainer-{local_rank}'}"

    @staticmethod
    def control_address(feed_dir: str | Path) -> str:
        """Where the node's first trainer announces the step its node needs next."""
        return f"ipc://{Path(feed_dir) / 'progress'}"

    def max_sockets(self, gpus_per_node: int) -> int:
        """The zmq sockets one feed process may open (the limit set on its context): a
        worker's senders to every local trainer, its subscription and its context's ZAP
        handler (``wire.WireContext``), with room to spare."""
        return gpus_per_node + 3


class CostConfig(_Model):
    """The cost model the plan was made with, so the run's predictions (TensorBoard's
    ``predicted/``) price its batches the same way (``cost.job.job_cost_model``): the
    analytic model's efficiencies (None: its defaults, ``cost.unit.Efficiency``), or the
    measured profile (``dtc compile --profile``, copied into the bundle)."""

    matmul: float | None = Field(default=None, gt=0, le=1)
    attention: float | None = Field(default=None, gt=0, le=1)
    conv: float | None = Field(default=None, gt=0, le=1)
    profile_file: BundleFile | None = None


class CheckpointConfig(_Model):
    every: int = Field(ge=0)       # steps between checkpoints (0: none)
    keep: int = Field(ge=1)        # the newest this many are kept


class Job(_Model):
    """``job.json``."""

    version: Literal[2] = JOB_VERSION
    spec: str                      # the spec's name
    spec_sha256: str
    program_sha256: str | None = None   # ir.checkpoint.program_sha256
    world_size: int = Field(ge=1)
    nodes: int = Field(ge=1)
    gpus_per_node: int = Field(ge=1)
    steps: int = Field(ge=1)
    reorder: tuple[Literal["intra", "inter"], ...]
    data: DataConfig
    feed: FeedConfig
    checkpoint: CheckpointConfig
    cost: CostConfig = Field(default_factory=CostConfig)
    program_file: BundleFile = "program.json"
    plan_file: BundleFile = "plan.json"
    schedule_file: BundleFile = "schedule.txt"
    secret_file: BundleFile = "job.key"

    @property
    def launched(self) -> int:
        """The processes torchrun starts: ``gpus_per_node`` on every node. When the plan's
        ranks do not fill the last node, the last ones in rendezvous order are spares
        that exit at once (``spares``): every node is launched alike, so that any node
        may come last in torchrun's order."""
        return self.nodes * self.gpus_per_node

    @property
    def spares(self) -> int:
        return self.launched - self.world_size

    def node_ranks(self, rank: int, local_rank: int, local_world: int) -> range:
        """The plan's ranks on the node of global ``rank`` (its ``LOCAL_RANK`` and
        ``LOCAL_WORLD_SIZE`` from torchrun): torchrun numbers a node's processes
        contiguously, so they are those from ``rank - local_rank`` on, spares left out."""
        first = rank - local_rank
        return range(first, min(first + local_world, self.world_size))


def load_job(bundle: str | Path) -> Job:
    """``bundle/job.json``; ValueError naming the file when it is missing or invalid."""
    path = Path(bundle) / "job.json"
    try:
        return Job.model_validate_json(path.read_bytes())
    except OSError as err:
        raise ValueError(f"cannot read {path}: {err.strerror or err}") from None
    except ValueError as err:
        version = _version_of(path)
        if version is not None and version != JOB_VERSION:
            raise ValueError(f"{path} was written by another dtc (job version {version}, "
                             f"this one reads {JOB_VERSION}): compile the bundle again") \
                from None
        why = validation_problems(err) if isinstance(err, ValidationError) else str(err)
        raise ValueError(f"{path} is not a valid job description: {why}") from None


def _version_of(path: Path) -> Any:
    import json

    try:
        return json.loads(path.read_bytes()).get("version")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None


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
