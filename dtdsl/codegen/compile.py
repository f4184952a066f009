"""``dtc compile``: from a checked spec and its plan to a launch bundle on disk."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtdsl.codegen.emit import emit_bundle
from dtdsl.codegen.slurm import SlurmOptions
from dtdsl.codegen.support import runtime_support
from dtdsl.codegen.views import bundle_view
from dtdsl.codes import DT411
from dtdsl.diagnostics import Severity
from dtdsl.ir import program as ir
from dtdsl.ir.checkpoint import program_sha256
from dtdsl.ir.job import CheckpointConfig, CostConfig, DataConfig, FeedConfig, Job
from dtdsl.ir.plan import Plan
from dtdsl.ir.schedule import Schedule
from dtdsl.schedule.validate import ScheduleError, validate_nccl

__all__ = ["BundleOptions", "DEFAULT_MAX_RESTARTS", "DEFAULT_RDZV_PORT",
           "compile_bundle", "make_job"]

DEFAULT_RDZV_PORT = 29500       # torchrun's rendezvous on multi-node launches
MAX_MESSAGE_BYTES = 1 << 30
PROFILE_FILE = "profile.json"    # the measured profile the plan was made with
# torchrun restarts every rank after one fails and the job resumes from its newest
# checkpoint (runtime.checkpoint): a few restarts ride out a lost rank without a person.
DEFAULT_MAX_RESTARTS = 3


@dataclass(frozen=True)
class BundleOptions:
    """What ``dtc compile``'s options decide (None: the spec's or the default)."""

    steps: int | None = None
    workers: int | None = None
    prefetch: int = 2
    data: str | None = None          # a dataset directory, as the user wrote it
    synthetic: bool = False          # samples drawn from the spec's distributions
    max_restarts: int | None = None  # None: DEFAULT_MAX_RESTARTS
    slurm: SlurmOptions = SlurmOptions()   # slurm.sbatch's --time, --partition, --account
    # The cost model the plan was made with (``dtc compile --efficiency/--profile``): the
    # run's predictions use it too. None: the analytic defaults.
    cost: Any = None


def _data(program: ir.Program, spec_dir: Path, out: Path, options: BundleOptions
          ) -> DataConfig:
    """The job's data source: ``--synthetic``, ``--data``, or the spec's source (relative to
    the bundle when it is relative; a brace pattern stays one). ``dtc compile`` has checked
    that it can be read; without any, ValueError (never drawn samples unasked)."""
    if options.synthetic:
        return DataConfig(kind="synthetic")
    if options.data is not None:
        where = str(Path(options.data).expanduser().absolute())
    elif program.data.source is not None:
        given = Path(program.data.source).expanduser()
        where = str(given if given.is_absolute() else spec_dir.absolute() / given)
    else:
        raise ValueError("the spec's data block names no source: give a dataset or ask for "
                         "synthetic samples")
    # Between the real folders: a `..` climbs from where a link leads, not from the
    # path's text (an output folder reached through a symbolic link).
    rel = os.path.relpath(os.path.realpath(where), os.path.realpath(out))
    return DataConfig(kind="dataset", path=Path(rel).as_posix())


def make_job(program: ir.Program, plan: Plan, data: DataConfig, options: BundleOptions
             ) -> Job:
    """The job description of a bundle."""
    world = plan.gpus_used
    per_node = min(program.cluster.gpus_per_node, world)
    nodes = math.ceil(world / per_node)
    workers = program.cluster.cpu_workers if options.workers is None else options.workers
    return Job(spec=program.name, spec_sha256=program.source_sha256,
               program_sha256=program_sha256(program), world_size=world,
               nodes=nodes, gpus_per_node=per_node,
               steps=options.steps or program.train.steps,
               reorder=tuple(sorted(program.train.reorder)), data=data,
               feed=FeedConfig(workers=workers,
                               workers_per_node=math.ceil(workers / nodes),
                               prefetch=options.prefetch,
                               max_message_bytes=MAX_MESSAGE_BYTES),
               checkpoint=CheckpointConfig(every=program.train.checkpoint_every,
                                           keep=program.train.keep_checkpoints),
               cost=_cost_config(options.cost))


def _cost_config(cost: Any) -> CostConfig:
    if cost is None:
        return CostConfig()
    e = cost.params.efficiency
    return CostConfig(matmul=e.matmul, attention=e.attention, conv=e.conv,
                      profile_file=PROFILE_FILE if cost.profile is not None else None)


def compile_bundle(out: str | Path, *, source: bytes, spec_path: str, program: ir.Program,
                   plan: Plan, schedule: Schedule, options: BundleOptions,
                   overwrite: bool = False) -> list[str]:
    """Write the bundle of ``program`` under ``plan`` into ``out``; the paths written.
    Warnings go to stderr. ValueError, before anything is written, for a spec or plan the
    runtime cannot train, whose TP groups span nodes unpriced (``dtc compile`` reports
    those as diagnostics first: ``support.runtime_support``) or whose schedule could
    deadlock under NCCL's rules (``schedule.validate.validate_nccl``)."""
    refused = [d for d in runtime_support(program, plan) if d.severity is Severity.ERROR]
    unsupported = [d for d in refused if d.code != DT411]
    if unsupported:
        raise ValueError("the runtime cannot train this spec yet: " +
                         "; ".join(d.message for d in unsupported))
    if refused:
        raise ValueError("the plan's TP groups span nodes it priced within one: " +
                         "; ".join(d.message for d in refused))
    try:
        validate_nccl(schedule)     # what runs on GPUs: NCCL's send and receive rules
    except ScheduleError as err:
        raise ValueError(f"the plan's schedule would hang on GPUs: {err}") from None
    options.slurm.check()
    spec_dir = Path(spec_path).parent if spec_path not in ("-", "<stdin>") else Path.cwd()
    data = _data(program, spec_dir, Path(out), options)
    job = make_job(program, plan, data, options)
    view = bundle_view(program, plan, schedule, job, rdzv_port=DEFAULT_RDZV_PORT,
                       max_restarts=DEFAULT_MAX_RESTARTS if options.max_restarts is None
                       else options.max_restarts, slurm=options.slurm)
    profile = options.cost.profile.profile if options.cost is not None and \
        options.cost.profile is not None else None
    return emit_bundle(out, source=source, program=program, plan=plan, schedule=schedule,
                       job=job, view=view, overwrite=overwrite, profile=profile)
