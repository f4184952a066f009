"""View models of a launch bundle: every decision the generated files embody, made here.

Templates only loop and substitute; what each file says comes from these frozen
dataclasses, built from the checked Program, the Plan and the lowered Schedule. Values
reach the templates as Python objects and leave them through the ``py`` (a Python
literal) and ``sh`` (a quoted shell word) filters only, so no text of the spec is ever
spliced into code.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Any

from dtdsl.codegen.slurm import SlurmOptions
from dtdsl.ir import program as ir
from dtdsl.ir.job import Job, RankEntry
from dtdsl.ir.plan import Plan
from dtdsl.ir.schedule import Schedule
from dtdsl.parallel.mesh import RankRole, UnitGrid, grids, hosted_units, phased_units

__all__ = ["BundleView", "RankFileView", "RankView", "bundle_view", "rank_file_name"]

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def rank_file_name(unit: str, stage: int) -> str:
    """The rank program of a unit's pipeline stage, relative to the bundle."""
    if not _IDENT.match(unit):   # the grammar's identifier rule: a compiler bug otherwise
        raise AssertionError(f"unit name {unit!r} is not an identifier")
    return f"ranks/{unit}_s{stage}.py"


@dataclass(frozen=True)
class RankView:
    """A global rank and the entry its stage program states for it."""

    rank: int
    entry: RankEntry


@dataclass(frozen=True)
class RankFileView:
    """One rank program: a pipeline stage of one unit and every rank that runs it."""

    path: str
    unit: str
    role: str
    stage: int
    layers: tuple[int, int]
    tp: int
    dp: int
    pp: int
    ranks: tuple[RankView, ...]
    schedule: tuple[str, ...]
    # The co-located modules the stage runs besides its unit, each with its projector
    # (``parallel.mesh.hosted_units``): ("vit", "vit_to_llm"), ...
    hosts: tuple[tuple[str, str], ...] = ()
    # The phased encoders every backbone stage runs before and after the pipeline, each
    # with its projector (``parallel.mesh.phased_units``).
    phased: tuple[tuple[str, str], ...] = ()

    @property
    def rank_list(self) -> str:
        return ", ".join(str(r.rank) for r in self.ranks)

    @property
    def hosts_text(self) -> str:
        """``"; runs the co-located vit (with vit_to_llm)"``, ``"; runs its share of the
        phased vit (with vit_to_llm)"``, or ``""``."""
        text = ""
        if self.hosts:
            text += "; runs the co-located " + ", ".join(f"{m} (with {p})"
                                                          for m, p in self.hosts)
        if self.phased:
            text += "; runs its share of the phased " + ", ".join(
                f"{m} (with {p})" for m, p in self.phased)
        return text


@dataclass(frozen=True)
class BundleView:
    """Everything the templates of one bundle read."""

    spec: str
    spec_sha256: str
    world_size: int
    nodes: int
    gpus_per_node: int
    steps: int
    workers: int
    prefetch: int
    workers_per_node: int
    reorder: tuple[str, ...]
    rdzv_port: int
    max_restarts: int
    slurm: SlurmOptions
    # Every node runs gpus_per_node processes; on the last node in torchrun's rendezvous
    # order those past the world size are spares that exit at once: what the last node
    # runs, a sentence ('' when every node is full).
    last_node: str
    launch_command: str                  # the README's first command: one node or several
    rank_files: tuple[RankFileView, ...]
    # Sentences on where the co-located and phased modules run (none without them).
    colocated: tuple[str, ...] = ()

    @property
    def rank_table(self) -> tuple[tuple[int, str], ...]:
        return tuple(sorted((r.rank, f.path) for f in self.rank_files for r in f.ranks))

    @property
    def reorder_text(self) -> str:
        return ", ".join(self.reorder) or "none"

    @property
    def job_name(self) -> str:
        return f"dtdsl-{self.spec}"


def _layers(grid: UnitGrid, plan: Plan, stage: int) -> tuple[int, int]:
    split = plan.unit(grid.name).layers_per_stage
    start = sum(split[:stage])
    return start, start + split[stage]


def _hosts(program: ir.Program, plan: Plan, grid: UnitGrid, stage: int, which: Any
           ) -> tuple[tuple[str, str], ...]:
    """The modules stage ``stage`` of ``grid`` runs besides its own, with their
    projectors: ``which`` is ``hosted_units`` (co-located) or ``phased_units``."""
    role = RankRole(rank=grid.rank(stage, 0, 0), grid=grid, stage=stage, replica=0,
                    tp_index=0)
    backbone = program.backbone.name
    return tuple((u.name, next(p.name for p in program.projectors if (
        (p.source, p.target) == (u.name, backbone) if u.role == "encoder"
        else (p.source, p.target) == (backbone, u.name))))
        for u in which(plan, role))


def _colocated(plan: Plan, files: tuple[RankFileView, ...]) -> tuple[str, ...]:
    """Where each co-located module runs, for the README."""
    out = []
    for f in files:
        for module, projector in f.hosts:
            u = plan.unit(module)
            how = "whole on every TP rank" if u.tp_replicated and u.tp > 1 else \
                f"TP {u.tp}" if u.tp > 1 else "unsplit"
            out.append(f"{u.role.capitalize()} {module} and its projector {projector} run "
                       f"on the GPUs of {f.unit}'s stage {f.stage} (`{f.path}`, ranks "
                       f"{f.rank_list}), co-located: {how}, data parallel over its {u.dp} "
                       f"replica{'s' if u.dp != 1 else ''}, in the same forward and backward "
                       "passes; it has no ranks of its own.")
    for module, projector in next((f.phased for f in files if f.phased), ()):
        u = plan.unit(module)
        stages = [f for f in files if f.phased]
        how = "whole on every TP rank" if u.tp_replicated and u.tp > 1 else \
            f"TP {u.tp}" if u.tp > 1 else "unsplit"
        out.append(f"{u.role.capitalize()} {module} and its projector {projector} run "
                   f"phased on the GPUs of {_stages_of(stages)} "
                   f"({', '.join(f'`{f.path}`' for f in stages)}): {how}, data parallel "
                   f"over {u.dp} replicas, each rank encoding its share of its backbone "
                   "replica's samples for the whole step before the pipeline's first "
                   "action (the embeddings go to the first stage) and, with the gradients "
                   "the first stage sends back, recomputing and running their backward "
                   "after its last; it has no ranks of its own.")
    return tuple(out)


def _stages_of(files) -> str:
    """"llm's stage" or "all 3 of llm's stages"."""
    unit = files[0].unit
    return f"{unit}'s stage" if len(files) == 1 else f"all {len(files)} of {unit}'s stages"


def _rank_files(program: ir.Program, plan: Plan, schedule: Schedule
                ) -> tuple[RankFileView, ...]:
    out = []
    for g in grids(plan):
        unit = plan.unit(g.name)
        for stage in range(g.pp):
            ranks = []
            # Every CP rank of every replica (context parallelism: ``parallel.mesh``).
            for replica, c, t in itertools.product(range(g.dp), range(g.cp), range(g.tp)):
                ranks.append(RankView(rank=g.rank(stage, replica, t, c), entry=RankEntry(
                    replica=replica, tp_index=t, tp_group=g.tp_group_ranks(stage, replica, c),
                    dp_group=g.dp_group_ranks(stage, t),
                    pp_group=g.pp_group_ranks(replica, t, c))))
            out.append(RankFileView(
                path=rank_file_name(g.name, stage), unit=g.name, role=unit.role, stage=stage,
                layers=_layers(g, plan, stage), tp=g.tp, dp=g.dp, pp=g.pp,
                ranks=tuple(sorted(ranks, key=lambda r: r.rank)),
                schedule=tuple(str(a) for a in schedule.stage(g.name, stage).actions),
                hosts=_hosts(program, plan, g, stage, hosted_units),
                phased=_hosts(program, plan, g, stage, phased_units)))
    return tuple(out)


def _last_node(world: int, nodes: int, per_node: int) -> str:
    """What the last node in the rendezvous order runs, when it holds spares."""
    first = (nodes - 1) * per_node
    spares = nodes * per_node - world
    if spares == 0:
        return ""
    ranks = f"rank {first}" if world - first == 1 else f"ranks {first}..{world - 1}"
    rest = ("its other process is a spare that exits" if spares == 1 else
            f"its other {spares} processes are spares that exit")
    return (f"The {world} ranks fill {nodes - 1} node{'s' if nodes > 2 else ''} and part of "
            f"one more: node {nodes - 1}, the last in torchrun's rendezvous order (by host "
            f"name), runs {world - first} of its {per_node} GPUs' ranks ({ranks}); {rest} "
            "at once.")


def bundle_view(program: ir.Program, plan: Plan, schedule: Schedule, job: Job, *,
                rdzv_port: int, max_restarts: int, slurm: SlurmOptions) -> BundleView:
    """The view of a bundle for ``program`` under ``plan``."""
    files = _rank_files(program, plan, schedule)
    return BundleView(
        spec=program.name, spec_sha256=program.source_sha256, world_size=job.world_size,
        nodes=job.nodes, gpus_per_node=job.gpus_per_node, steps=job.steps,
        workers=job.feed.workers, prefetch=job.feed.prefetch,
        workers_per_node=job.feed.workers_per_node, reorder=tuple(job.reorder),
        rdzv_port=rdzv_port, max_restarts=max_restarts, slurm=slurm,
        last_node=_last_node(job.world_size, job.nodes, job.gpus_per_node),
        launch_command="./launch.sh" if job.nodes == 1 else "sbatch slurm.sbatch",
        rank_files=files, colocated=_colocated(plan, files))
