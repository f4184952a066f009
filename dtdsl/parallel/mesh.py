"""Rank grids and process groups of a Plan's parallelism units.

Each unit owns the contiguous global ranks ``first_rank .. first_rank + pp*dp*tp - 1``,
laid out as a (pp, dp, tp) grid with TP innermost::

    rank = first_rank + (stage * dp + replica) * tp + tp_index

(the rule of ``ScheduleUnit.ranks`` and ``TimelineUnit.rank``). A unit has

* one **TP group** per (stage, replica): the ``tp`` ranks that shard one stage's layers;
* one **DP group** per (stage, tp_index): the ``dp`` ranks holding the same shard of the
  same stage, which all-reduce (or reduce-scatter) its gradients;
* one **PP group** per (replica, tp_index): the ``pp`` ranks along the pipeline.

Every global rank of a unit is in exactly one group of each kind.

**Meshes.** ``build_groups`` makes one ``DeviceMesh`` per unit over the unit's ranks,
shaped ``(pp, dp_replicate, dp_shard, tp)`` (``MESH_DIMS``): the DP ranks are a shard
dimension under ZeRO >= 1 (FSDP2 shards over it) and a replicate dimension under ZeRO 0.
Its TP dimension is the TP group above, its DP dimensions the DP group, its PP dimension
the PP group. DeviceMesh creates each dimension's groups with ``new_group``, which is
collective over the whole default group, so every rank builds every unit's mesh, in plan
order, and keeps its own. Any other code that creates groups must do so entirely before or
entirely after ``build_groups`` on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:   # torch is imported where groups are built: planning tools never pay for it
    from torch.distributed import ProcessGroup

    from dtdsl.ir.plan import Plan, UnitPlan

__all__ = ["MESH_DIMS", "ProcessGroups", "RankRole", "UnitGrid", "build_groups", "grids",
           "role_of", "unit_mesh_shape"]

Role = Literal["encoder", "backbone", "generator"]


@dataclass(frozen=True, slots=True, kw_only=True)
class UnitGrid:
    """The (pp, dp, tp) rank grid of one unit."""

    name: str
    role: Role
    tp: int
    dp: int
    pp: int
    first_rank: int = 0

    def __post_init__(self) -> None:
        if min(self.tp, self.dp, self.pp) < 1:
            raise ValueError(f"{self.name}: tp, dp and pp must be at least 1")
        if self.first_rank < 0:
            raise ValueError(f"{self.name}: first_rank must be non-negative")

    @staticmethod
    def of(unit: UnitPlan) -> UnitGrid:
        grid = UnitGrid(name=unit.name, role=unit.role, tp=unit.tp, dp=unit.dp, pp=unit.pp,
                        first_rank=unit.first_rank)
        if grid.size != unit.gpus:
            raise ValueError(f"{unit.name}: gpus={unit.gpus} but pp*dp*tp={grid.size}")
        return grid

    @property
    def size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.size)

    @property
    def last_stage(self) -> int:
        return self.pp - 1

    def rank(self, stage: int, replica: int, tp_index: int = 0) -> int:
        """The global rank at (stage, replica, tp_index)."""
        if not (0 <= stage < self.pp and 0 <= replica < self.dp and 0 <= tp_index < self.tp):
            raise IndexError(f"{self.name}: ({stage}, {replica}, {tp_index}) is outside the "
                             f"grid pp={self.pp} dp={self.dp} tp={self.tp}")
        return self.first_rank + (stage * self.dp + replica) * self.tp + tp_index

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(stage, replica, tp_index) of a global rank of this unit."""
        if rank not in self.ranks:
            raise IndexError(f"rank {rank} is not in unit {self.name} ({self.ranks})")
        rest, tp_index = divmod(rank - self.first_rank, self.tp)
        stage, replica = divmod(rest, self.dp)
        return stage, replica, tp_index

    def stage_ranks(self, stage: int) -> range:
        """All ranks of ``stage`` (every replica and TP rank); equals ``ScheduleUnit.ranks``."""
        start = self.rank(stage, 0, 0)
        return range(start, start + self.dp * self.tp)

    def leader(self, stage: int, replica: int) -> int:
        """The first TP rank of ``replica`` at ``stage``: the one that talks to other units."""
        return self.rank(stage, replica, 0)

    def tp_group_ranks(self, stage: int, replica: int) -> tuple[int, ...]:
        return tuple(self.rank(stage, replica, t) for t in range(self.tp))

    def dp_group_ranks(self, stage: int, tp_index: int) -> tuple[int, ...]:
        return tuple(self.rank(stage, r, tp_index) for r in range(self.dp))

    def pp_group_ranks(self, replica: int, tp_index: int) -> tuple[int, ...]:
        return tuple(self.rank(s, replica, tp_index) for s in range(self.pp))

    def tp_groups(self) -> tuple[tuple[int, ...], ...]:
        """Every TP group, stage-major then replica (the creation order)."""
        return tuple(self.tp_group_ranks(s, r) for s in range(self.pp) for r in range(self.dp))

    def dp_groups(self) -> tuple[tuple[int, ...], ...]:
        """Every DP group, stage-major then tp_index (the creation order)."""
        return tuple(self.dp_group_ranks(s, t) for s in range(self.pp) for t in range(self.tp))

    def pp_groups(self) -> tuple[tuple[int, ...], ...]:
        """Every PP group, replica-major then tp_index (the creation order)."""
        return tuple(self.pp_group_ranks(r, t) for r in range(self.dp) for t in range(self.tp))


@dataclass(frozen=True, slots=True, kw_only=True)
class RankRole:
    """What one global rank is: a position in one unit's grid."""

    rank: int
    grid: UnitGrid
    stage: int
    replica: int
    tp_index: int

    @property
    def unit(self) -> str:
        return self.grid.name

    @property
    def role(self) -> Role:
        return self.grid.role

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.grid.pp - 1

    @property
    def is_leader(self) -> bool:
        """First TP rank of its (stage, replica)."""
        return self.tp_index == 0

    @property
    def tp_ranks(self) -> tuple[int, ...]:
        return self.grid.tp_group_ranks(self.stage, self.replica)

    @property
    def dp_ranks(self) -> tuple[int, ...]:
        return self.grid.dp_group_ranks(self.stage, self.tp_index)

    @property
    def pp_ranks(self) -> tuple[int, ...]:
        return self.grid.pp_group_ranks(self.replica, self.tp_index)


def grids(plan: Plan) -> tuple[UnitGrid, ...]:
    """The grid of every unit, in plan order; checks that the units tile ranks 0..n-1."""
    out = tuple(UnitGrid.of(u) for u in plan.units)
    expected = 0
    for g in sorted(out, key=lambda g: g.first_rank):
        if g.first_rank != expected:
            raise ValueError(f"unit {g.name} starts at rank {g.first_rank}, expected {expected} "
                             "(units must tile the ranks without gaps or overlaps)")
        expected += g.size
    return out


def role_of(plan: Plan, rank: int) -> RankRole:
    """The unit position of a global rank."""
    for g in grids(plan):
        if rank in g.ranks:
            stage, replica, tp_index = g.coords(rank)
            return RankRole(rank=rank, grid=g, stage=stage, replica=replica, tp_index=tp_index)
    raise IndexError(f"rank {rank} belongs to no unit of the plan (0..{_world(plan) - 1})")


def _world(plan: Plan) -> int:
    return sum(u.gpus for u in plan.units)


@dataclass(frozen=True, slots=True, kw_only=True)
class ProcessGroups:
    """This rank's place in its unit: the unit's DeviceMesh (``("pp", "dp_replicate",
    "dp_shard", "tp")``) and the TP process group."""

    role: RankRole
    mesh: Any
    tp: ProcessGroup

    @property
    def rank(self) -> int:
        return self.role.rank


MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


def unit_mesh_shape(grid: UnitGrid, zero: int) -> tuple[int, int, int, int]:
    """The unit's mesh shape ``(pp, dp_replicate, dp_shard, tp)``: data parallelism
    shards (ZeRO >= 1) or replicates (ZeRO 0) over the DP ranks."""
    return (grid.pp, 1, grid.dp, grid.tp) if zero >= 1 else (grid.pp, grid.dp, 1, grid.tp)


def build_groups(plan: Plan, *, device_type: str = "cpu", zero: int = 1) -> ProcessGroups:
    """Build every unit's DeviceMesh (``MESH_DIMS``: the unit's ranks laid out as in the
    module docstring, TP innermost) on this rank, in plan order, and return this rank's.
    Collective: every rank of the default group calls it (DeviceMesh creates its process
    groups with ``new_group``, which every rank must call for every group, member or not).
    The default group's size must equal the plan's ranks."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if not dist.is_initialized():
        raise RuntimeError("build_groups needs torch.distributed to be initialised")
    world = dist.get_world_size()
    if world != _world(plan):
        raise ValueError(f"the plan uses {_world(plan)} ranks but the world size is {world}")
    rank = dist.get_rank()
    role = role_of(plan, rank)
    mine = None
    for g in grids(plan):
        ranks = torch.arange(g.first_rank, g.first_rank + g.size).reshape(
            unit_mesh_shape(g, zero))
        mesh = DeviceMesh(device_type, ranks, mesh_dim_names=MESH_DIMS)
        if g.name == role.unit:
            mine = mesh
    assert mine is not None
    return ProcessGroups(role=role, mesh=mine, tp=mine.get_group("tp"))
