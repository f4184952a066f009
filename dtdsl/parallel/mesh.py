"""Rank grids and process groups of a Plan's parallelism units.

Each unit owns the contiguous global ranks ``first_rank .. first_rank + pp*dp*cp*tp - 1``,
laid out as a (pp, dp, cp, tp) grid with TP innermost, then CP (Megatron-LM's order)::

    rank = first_rank + ((stage * dp + replica) * cp + cp_index) * tp + tp_index

(the rule of ``ir.plan``, ``ScheduleUnit.ranks`` and ``TimelineUnit.rank``; cp is 1 unless
the plan uses context parallelism). A unit has

* one **TP group** per (stage, replica, cp_index): the ``tp`` ranks that shard one stage's
  layers;
* one **CP group** per (stage, replica, tp_index): the ``cp`` ranks that hold the shards
  of one replica's sequences (``parallel.cp``), a group of its own (``<unit>.cp`` in
  ``rank_groups``), only where cp > 1;
* one **DP group** per (stage, tp_index): the ``dp x cp`` ranks holding the same shard of
  the same stage, which all-reduce (or reduce-scatter) its gradients (the CP ranks of a
  replica hold the same parameters and see different tokens, so they reduce together);
* one **PP group** per (replica, cp_index, tp_index): the ``pp`` ranks along the
  pipeline (stage s's CP rank r talks to stage s+1's CP rank r).

Every global rank of a unit is in exactly one group of each kind. Since CP sits between
TP and DP, a stage's ``dp x cp`` ranks of one tp_index are ``dp' = dp * cp`` "replicas"
of the (pp, dp', tp) grid: the mesh below is that grid, and its DP dimension is the
DP group above.

**Co-located units** (``UnitPlan.colocated``: an encoder on the backbone's first pipeline
stage, a generator on its last, ``gpus`` 0) have no grid, ranks or groups of their own:
they run inside their host stage, on its TP group and DP mesh (``hosted_units``), so
``grids`` leaves them out and every rank of the job belongs to a unit with GPUs.

**Phased encoders** (``UnitPlan.phased``: an encoder whose forward runs before the
pipeline and backward after it, data-parallel over all the backbone's ranks, ``gpus`` 0)
have no ranks of their own either, but a grid over the backbone's ranks
(``phased_grid``): pp 1, dp = the backbone's dp x pp, the backbone's tp, so its replica
q = stage * dp + replica is every backbone rank's ``(rank - first_rank) // tp``. Its TP
group through a rank is the backbone's TP group (the same process group); its DP group is
every backbone rank with the same tp_index, over all stages and replicas, a group of its
own (``phased_meshes``) unless it has the ranks of one of the backbone's (its DP group
when pp is 1, its PP group when dp is 1), which is then used again.

**Expert parallelism** (``UnitPlan.ep`` > 1, an MoE backbone): the ``dp`` replicas of a
stage (at one tp_index) form ``dp / ep`` **EP groups** of ``ep`` consecutive replicas
(replica ``r`` is in EP group ``r // ep``, at EP rank ``r % ep``), over which each MoE
block's experts are split (``parallel.ep``: EP rank ``i`` holds experts ``[i E/ep,
(i + 1) E/ep)``) and its tokens exchanged; the replicas at the same EP rank of every EP
group hold the same experts and form an **expert DP group** of ``dp / ep`` ranks, over
which FSDP2 shards and reduces those experts (the rest of the stage shards over the
whole DP group as before). Consecutive replicas keep an EP group's all-to-alls inside a
node where the DP ranks are laid out node by node. Both are groups of their own
(``<unit>.ep``, ``<unit>.ep_dp`` in ``rank_groups``; ``ProcessGroups.ep``), made after
every other group (``build_groups``), the expert DP group the one dimension of a
DeviceMesh (``ep_mesh``). Under Local SGD with replicas of N ranks (``replica_dp``) each
EP group lies inside one replica (ep divides N, DT636) and the expert DP group is the
replica's own N / ep ranks at the same EP rank; the ranks at the same place in the
other replicas (the unit's ``dp_replicate`` line) hold the same experts, and Local SGD
synchronises the experts with them as it does the rest (``ExpertGroups.replicas``).

**Meshes and groups.** ``build_groups`` gives each rank its unit's ``DeviceMesh`` over
the unit's ranks, shaped ``(pp, dp_replicate, dp_shard, tp)`` (``MESH_DIMS``): the DP
ranks are a shard dimension under ZeRO >= 1 (FSDP2 shards over it) and a replicate
dimension under ZeRO 0; under Local SGD with replicas of N ranks (``local_sgd(replica_dp=
N)``) each replica's N consecutive DP ranks are the shard dimension and the ranks at the
same place in every replica the replicate one. The mesh is assembled
(``DeviceMesh.from_group``) from the groups this rank is a member of and nothing else
(``rank_groups``, a pure function of the plan, so a dry run checks exactly what runs),
created one dimension after the other in ``MESH_DIMS`` order by their members alone
(``new_group(..., use_local_synchronization=True)``). No rank takes part in another
unit's groups (but a phased encoder's DP group, made last), so a 1170-rank job makes a
few groups per rank, and with gloo a rank holds sockets to its TP, DP and PP peers only.
The order is the same on every rank, every rank is in one group of each kind, and torch
names a group after its ranks and the groups its process made before: every rank must
have made as many before ``build_groups`` (none: it runs first).

A dimension on which a rank is alone (tp = 1, pp = 1, the DP dimension ZeRO does not use,
dp = 1) gets a group of torch's ``fake`` backend (torch's and torchtitan's placeholder for
a disabled dimension: no communicator, nothing sent), set to raise on any collective.

Where the default group is bound to a device (NCCL with ``device_id``, as on GPUs), torch
creates communicators with ``ncclCommSplit``, collective over the default group, and a
members-only creation would hang: there each real group is split from the default group
(``split_group``), every rank calling it once per mesh dimension with the dimension's
groups across the job (``dim_groups``). Other code creating groups does so through
``new_subgroup``, which follows the same rule (the tied embeddings' pair,
``train.stage``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from dtdsl.parallel.ep_groups import ExpertGroups, ep_lines
from dtdsl.parallel.replicas import dp_lines, shards

if TYPE_CHECKING:   # torch is imported where groups are built: planning tools never pay for it
    from torch.distributed import ProcessGroup

    from dtdsl.ir.plan import Plan, UnitPlan

__all__ = ["MESH_DIMS", "ExpertGroups", "ProcessGroups", "RankRole", "UnitGrid",
           "build_groups", "colocation_problems", "cp_ulysses", "data_parallel_mesh",
           "dim_groups", "ep_lines", "grids", "hosted_units", "new_subgroup", "phased_grid",
           "phased_groups", "phased_problems", "phased_role", "phased_units", "rank_groups",
           "role_of", "splits_groups", "unit_mesh_shape"]

Role = Literal["encoder", "backbone", "generator"]


@dataclass(frozen=True, slots=True, kw_only=True)
class UnitGrid:
    """The (pp, dp, cp, tp) rank grid of one unit."""

    name: str
    role: Role
    tp: int
    dp: int
    pp: int
    first_rank: int = 0
    cp: int = 1

    def __post_init__(self) -> None:
        if min(self.tp, self.dp, self.pp, self.cp) < 1:
            raise ValueError(f"{self.name}: tp, dp, pp and cp must be at least 1")
        if self.first_rank < 0:
            raise ValueError(f"{self.name}: first_rank must be non-negative")

    @staticmethod
    def of(unit: UnitPlan) -> UnitGrid:
        grid = UnitGrid(name=unit.name, role=unit.role, tp=unit.tp, dp=unit.dp, pp=unit.pp,
                        first_rank=unit.first_rank, cp=unit.cp)
        if grid.size != unit.gpus:
            raise ValueError(f"{unit.name}: gpus={unit.gpus} but pp*dp*cp*tp={grid.size}")
        return grid

    @property
    def size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.size)

    @property
    def last_stage(self) -> int:
        return self.pp - 1

    def rank(self, stage: int, replica: int, tp_index: int = 0, cp_index: int = 0) -> int:
        """The global rank at (stage, replica, cp_index, tp_index)."""
        if not (0 <= stage < self.pp and 0 <= replica < self.dp and 0 <= tp_index < self.tp
                and 0 <= cp_index < self.cp):
            raise IndexError(f"{self.name}: stage {stage}, replica {replica}, cp {cp_index}, "
                             f"tp {tp_index} is outside the grid pp={self.pp} dp={self.dp} "
                             f"cp={self.cp} tp={self.tp}")
        return self.first_rank + ((stage * self.dp + replica) * self.cp + cp_index) * self.tp \
            + tp_index

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(stage, replica, tp_index) of a global rank of this unit (``cp_index``: its
        place in its CP group)."""
        if rank not in self.ranks:
            raise IndexError(f"rank {rank} is not in unit {self.name} ({self.ranks})")
        rest, tp_index = divmod(rank - self.first_rank, self.tp)
        stage, replica = divmod(rest // self.cp, self.dp)
        return stage, replica, tp_index

    def cp_index(self, rank: int) -> int:
        """A global rank's index in its CP group (0 without context parallelism)."""
        if rank not in self.ranks:
            raise IndexError(f"rank {rank} is not in unit {self.name} ({self.ranks})")
        return (rank - self.first_rank) // self.tp % self.cp

    def stage_ranks(self, stage: int) -> range:
        """All ranks of ``stage`` (every replica, CP and TP rank); equals
        ``ScheduleUnit.ranks``."""
        start = self.rank(stage, 0, 0)
        return range(start, start + self.dp * self.cp * self.tp)

    def leader(self, stage: int, replica: int) -> int:
        """The first TP rank of the first CP rank of ``replica`` at ``stage``: the one that
        talks to other units."""
        return self.rank(stage, replica, 0)

    def tp_group_ranks(self, stage: int, replica: int, cp_index: int = 0) -> tuple[int, ...]:
        return tuple(self.rank(stage, replica, t, cp_index) for t in range(self.tp))

    def cp_group_ranks(self, stage: int, replica: int, tp_index: int = 0) -> tuple[int, ...]:
        return tuple(self.rank(stage, replica, tp_index, c) for c in range(self.cp))

    def replica_ranks(self, stage: int, replica: int) -> tuple[int, ...]:
        """Every rank of ``replica`` at ``stage``: its CP x TP ranks, which read the same
        samples (consecutive ranks)."""
        start = self.rank(stage, replica, 0)
        return tuple(range(start, start + self.cp * self.tp))

    def dp_group_ranks(self, stage: int, tp_index: int) -> tuple[int, ...]:
        """The ranks that reduce a stage's gradients together: every replica's every CP
        rank with this tp_index (module docstring)."""
        return tuple(self.rank(stage, r, tp_index, c) for r in range(self.dp)
                     for c in range(self.cp))

    def pp_group_ranks(self, replica: int, tp_index: int, cp_index: int = 0
                       ) -> tuple[int, ...]:
        return tuple(self.rank(s, replica, tp_index, cp_index) for s in range(self.pp))

    def tp_groups(self) -> tuple[tuple[int, ...], ...]:
        """Every TP group, stage-major, then replica, then cp_index (the creation order)."""
        return tuple(self.tp_group_ranks(s, r, c) for s in range(self.pp)
                     for r in range(self.dp) for c in range(self.cp))

    def cp_groups(self) -> tuple[tuple[int, ...], ...]:
        """Every CP group, stage-major, then replica, then tp_index (the creation order)."""
        return tuple(self.cp_group_ranks(s, r, t) for s in range(self.pp)
                     for r in range(self.dp) for t in range(self.tp))

    def dp_groups(self) -> tuple[tuple[int, ...], ...]:
        """Every DP group, stage-major then tp_index (the creation order)."""
        return tuple(self.dp_group_ranks(s, t) for s in range(self.pp) for t in range(self.tp))

    def pp_groups(self) -> tuple[tuple[int, ...], ...]:
        """Every PP group, replica-major, then cp_index, then tp_index (the creation
        order)."""
        return tuple(self.pp_group_ranks(r, t, c) for r in range(self.dp)
                     for c in range(self.cp) for t in range(self.tp))


@dataclass(frozen=True, slots=True, kw_only=True)
class RankRole:
    """What one global rank is: a position in one unit's grid."""

    rank: int
    grid: UnitGrid
    stage: int
    replica: int
    tp_index: int
    cp_index: int = 0

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
        """First TP rank of the first CP rank of its (stage, replica)."""
        return self.tp_index == 0 and self.cp_index == 0

    @property
    def counts_loss(self) -> bool:
        """First TP rank of its CP rank: the TP ranks hold the same loss, the CP ranks
        each the loss of their own tokens (so the loss is counted once per CP rank)."""
        return self.tp_index == 0

    @property
    def tp_ranks(self) -> tuple[int, ...]:
        return self.grid.tp_group_ranks(self.stage, self.replica, self.cp_index)

    @property
    def cp_ranks(self) -> tuple[int, ...]:
        return self.grid.cp_group_ranks(self.stage, self.replica, self.tp_index)

    @property
    def dp_ranks(self) -> tuple[int, ...]:
        return self.grid.dp_group_ranks(self.stage, self.tp_index)

    @property
    def pp_ranks(self) -> tuple[int, ...]:
        return self.grid.pp_group_ranks(self.replica, self.tp_index, self.cp_index)


def grids(plan: Plan) -> tuple[UnitGrid, ...]:
    """The grid of every unit with GPUs of its own, in plan order (co-located and phased
    units run on the backbone's ranks: ``hosted_units``, ``phased_units``); checks that
    the units tile ranks 0..n-1."""
    out = tuple(UnitGrid.of(u) for u in plan.units if not (u.colocated or u.phased))
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
            return RankRole(rank=rank, grid=g, stage=stage, replica=replica, tp_index=tp_index,
                            cp_index=g.cp_index(rank))
    raise IndexError(f"rank {rank} belongs to no unit of the plan (0..{_world(plan) - 1})")


def _world(plan: Plan) -> int:
    return sum(u.gpus for u in plan.units)


def colocation_problems(plan: Plan) -> list[str]:
    """What is wrong with the plan's co-located units for the runtime, in plain words
    (empty when nothing is): a co-located unit is an encoder or a generator that runs
    on the backbone's first or last stage with the backbone's TP and DP, one stage of
    all its layers and one model chunk, and no GPU of its own."""
    backbone = next((u for u in plan.units if u.role == "backbone"), None)
    out = []
    for u in plan.units:
        if not u.colocated:
            continue
        if backbone is None or u.role == "backbone":
            out.append(f"{u.name}: only an encoder or a generator can be co-located on the "
                       "backbone's stages")
            continue
        if u.gpus != 0:
            out.append(f"{u.name}: a co-located unit holds no GPU of its own, not {u.gpus}")
        for what, got, want in (("tp", u.tp, backbone.tp), ("dp", u.dp, backbone.dp),
                                ("first_rank", u.first_rank, backbone.first_rank)):
            if got != want:
                out.append(f"{u.name}: {what} {got}, but a co-located unit runs on the "
                           f"backbone's ranks with its {what} ({backbone.name}: {want})")
        if u.pp != 1 or u.vpp != 1 or len(u.layers_per_stage) != 1:
            out.append(f"{u.name}: pp {u.pp}, vpp {u.vpp} and layers_per_stage "
                       f"{list(u.layers_per_stage)}; a co-located unit runs all its layers "
                       "in one model chunk of its host stage (pp 1, vpp 1)")
    return out


def hosted_units(plan: Plan, role: RankRole) -> tuple[UnitPlan, ...]:
    """The co-located units ``role``'s stage runs besides its own (plan order): the
    encoders on the backbone's first stage, the generators on its last (both on a
    backbone of one stage); none elsewhere. ValueError for a plan whose co-located units
    the runtime cannot place (``colocation_problems``)."""
    if role.role != "backbone" or not any(u.colocated for u in plan.units):
        return ()
    problems = colocation_problems(plan)
    if problems:
        raise ValueError("the plan's co-located units cannot run: " + "; ".join(problems))
    return tuple(u for u in plan.units if u.colocated and (
        (u.role == "encoder" and role.is_first_stage) or
        (u.role == "generator" and role.is_last_stage)))



def phased_problems(plan: Plan) -> list[str]:
    """What is wrong with the plan's phased units for the runtime, in plain words (empty
    when nothing is): a phased unit is an encoder on all the backbone's ranks, with the
    backbone's tp and first rank, dp = the backbone's dp x pp, one stage of all its
    layers and one model chunk, and no GPU of its own (``UnitPlan.phased``)."""
    backbone = next((u for u in plan.units if u.role == "backbone"), None)
    out = []
    for u in plan.units:
        if not u.phased:
            continue
        if backbone is None or u.role != "encoder":
            out.append(f"{u.name}: only an encoder can run phased (before and after the "
                       f"backbone's pipeline), not a {u.role}; plan it disaggregated or "
                       "co-located")
            continue
        if u.colocated:
            out.append(f"{u.name}: a unit is phased or co-located, not both")
        if backbone.cp > 1:
            out.append(f"{u.name}: a phased encoder runs on the backbone's ranks as dp x pp "
                       f"replicas, which a backbone with context parallelism (cp "
                       f"{backbone.cp}) does not lay out; plan it disaggregated or "
                       "co-located")
        if u.gpus != 0:
            out.append(f"{u.name}: a phased unit holds no GPU of its own, not {u.gpus}")
        for what, got, want in (("tp", u.tp, backbone.tp),
                                ("dp", u.dp, backbone.dp * backbone.pp),
                                ("first_rank", u.first_rank, backbone.first_rank)):
            if got != want:
                out.append(f"{u.name}: {what} {got}, but a phased unit runs on all the "
                           f"backbone's ranks with {what} {want} ({backbone.name}: tp "
                           f"{backbone.tp}, dp {backbone.dp} x pp {backbone.pp})")
        if u.pp != 1 or u.vpp != 1 or len(u.layers_per_stage) != 1:
            out.append(f"{u.name}: pp {u.pp}, vpp {u.vpp} and layers_per_stage "
                       f"{list(u.layers_per_stage)}; a phased unit runs all its layers in "
                       "one model chunk (pp 1, vpp 1)")
    return out


def phased_units(plan: Plan, role: RankRole) -> tuple[UnitPlan, ...]:
    """The phased encoders ``role``'s rank runs before and after the pipeline (plan
    order): every one of the plan's on every backbone rank, none elsewhere. ValueError
    for a plan whose phased units the runtime cannot place (``phased_problems``)."""
    if role.role != "backbone" or not any(u.phased for u in plan.units):
        return ()
    problems = phased_problems(plan)
    if problems:
        raise ValueError("the plan's phased units cannot run: " + "; ".join(problems))
    return tuple(u for u in plan.units if u.phased)


def phased_grid(plan: Plan, unit: UnitPlan) -> UnitGrid:
    """A phased unit's grid over its backbone's ranks (module docstring): pp 1, dp = the
    backbone's dp x pp, the backbone's tp; replica q is the backbone's (stage, replica) =
    divmod(q, backbone dp)."""
    backbone = next(u for u in plan.units if u.role == "backbone")
    return UnitGrid(name=unit.name, role=unit.role, tp=backbone.tp,
                    dp=backbone.dp * backbone.pp, pp=1, first_rank=backbone.first_rank)


def phased_role(plan: Plan, unit: UnitPlan, rank: int) -> RankRole:
    """``rank``'s place in phased unit ``unit``'s grid (``phased_grid``)."""
    grid = phased_grid(plan, unit)
    stage, replica, tp_index = grid.coords(rank)
    return RankRole(rank=rank, grid=grid, stage=stage, replica=replica, tp_index=tp_index)



# ---- the unit's mesh and the groups behind it ------------------------------------------------

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


def unit_mesh_shape(grid: UnitGrid, zero: int, replica_dp: int = 1) -> tuple[int, ...]:
    """The unit's mesh shape ``(pp, dp_replicate, dp_shard, tp)``: data parallelism
    shards (ZeRO >= 1) or replicates (ZeRO 0) over the DP ranks (``dp x cp`` of them:
    module docstring); under Local SGD with ``replica_dp`` ranks per replica, ``dp /
    replica_dp`` replicas of ``replica_dp`` consecutive DP ranks each."""
    n = shards(grid.dp * grid.cp, zero, replica_dp)
    return (grid.pp, grid.dp * grid.cp // n, n, grid.tp)


def _lines(role: RankRole, zero: int, replica_dp: int = 1) -> dict[str, tuple[int, ...]]:
    """The ranks along each mesh dimension through ``role.rank`` (the rank alone on a
    dimension of size one), in mesh order: ``unit_mesh_shape``'s dimensions are the PP,
    DP and TP groups of the grid (the DP group split into its replicas' shards)."""
    ranks = role.dp_ranks
    dp = dp_lines(ranks, shards(len(ranks), zero, replica_dp), ranks.index(role.rank))
    return {"pp": role.pp_ranks, **dp, "tp": role.tp_ranks}


def cp_ulysses(program: Any, plan: Plan) -> dict[str, int]:
    """The Ulysses degree of each unit of ``plan`` with hybrid context parallelism (its
    module's ``context_parallel``), as the cost model splits it (``ir.plan.cp_split``
    on the program's nodes): the shape of its ``(cp_ring, cp_ulysses)`` mesh."""
    from dtdsl.ir.plan import cp_split

    out = {}
    for u in plan.units:
        if u.cp > 1 and program.module(u.name).context_parallel == "hybrid":
            out[u.name] = cp_split("hybrid", u.cp, u.tp, program.cluster.gpus_per_node)[1]
    return out


def _cp_lines(role: RankRole, ulysses: int) -> dict[str, tuple[int, ...]]:
    """The CP groups through ``role.rank`` (none at cp 1): one ``cp`` group, or for hybrid
    context parallelism with ``ulysses`` ranks per ring index the ``cp_ring`` and
    ``cp_ulysses`` lines of its ``(ring, ulysses)`` mesh (``parallel.cp``: CP rank
    ``i * ulysses + j``)."""
    ranks = role.cp_ranks
    cp = len(ranks)
    if cp == 1:
        return {}
    if ulysses in (1, cp):
        return {"cp": ranks}
    if cp % ulysses:
        raise ValueError(f"{role.unit}: a Ulysses degree of {ulysses} does not divide cp {cp}")
    i, j = divmod(role.cp_index, ulysses)
    return {"cp_ring": ranks[j::ulysses], "cp_ulysses": ranks[i * ulysses:(i + 1) * ulysses]}


def _cp_family(plan: Plan, unit: str, dim: str, ulysses: int) -> tuple[tuple[int, ...], ...]:
    """Every group of CP dimension ``dim`` (``_cp_lines``) of ``unit`` (groups of one rank
    left out): the split of the default group that ``split_group`` makes for it."""
    grid = next(g for g in grids(plan) if g.name == unit)
    out: list[tuple[int, ...]] = []
    for group in grid.cp_groups():
        if dim == "cp_ring":
            out.extend(group[j::ulysses] for j in range(ulysses))
        elif dim == "cp_ulysses":
            out.extend(group[i:i + ulysses] for i in range(0, len(group), ulysses))
        else:
            out.append(group)
    return tuple(x for x in out if len(x) > 1)


def rank_groups(plan: Plan, rank: int, zero: int = 1, ulysses: dict[str, int] | None = None,
                replica_dp: int = 1) -> dict[str, tuple[int, ...]]:
    """The process groups ``build_groups`` creates on ``rank``: mesh dimension -> the
    member ranks (ascending, so group rank = mesh coordinate), in creation order; the
    dimensions this rank is alone on are left out (they get no group, module docstring);
    a unit's CP groups (cp > 1) as ``<unit>.cp``, or for hybrid context parallelism
    (``ulysses``: ``cp_ulysses``) ``<unit>.cp_ring`` and ``<unit>.cp_ulysses``, after the
    mesh's. Pure: a dry run compares it with what torch built without running the job."""
    role = role_of(plan, rank)
    out = {dim: ranks for dim, ranks in _lines(role, zero, replica_dp).items()
           if len(ranks) > 1}
    for dim, ranks in _cp_lines(role, (ulysses or {}).get(role.unit, 1)).items():
        if len(ranks) > 1:
            out[f"{role.unit}.{dim}"] = ranks
    for u in phased_units(plan, role):
        if _phased_reuses(plan, zero) is None:
            dim = _phased_dp_dim(zero)
            ranks = _lines(phased_role(plan, u, rank), zero)[dim]
            if len(ranks) > 1:
                out[f"{u.name}.{dim}"] = ranks
    for dim, ranks in ep_lines(role, plan.unit(role.unit).ep, replica_dp).items():
        if len(ranks) > 1:
            out[f"{role.unit}.{dim}"] = ranks
    return out


def _ep_family(plan: Plan, unit: str, dim: str, replica_dp: int = 1
               ) -> tuple[tuple[int, ...], ...]:
    """Every group of ``unit``'s expert-parallel dimension ``dim`` (``ep_lines``), groups
    of one rank left out: the split of the default group ``split_group`` makes for it."""
    out: list[tuple[int, ...]] = []
    for rank in plan.unit(unit).ranks:
        ranks = ep_lines(role_of(plan, rank), plan.unit(unit).ep, replica_dp)[dim]
        if len(ranks) > 1 and ranks not in out:
            out.append(ranks)
    return tuple(out)


def _phased_dp_dim(zero: int) -> str:
    """The mesh dimension a phased unit's DP ranks are on (``unit_mesh_shape``)."""
    return "dp_shard" if zero >= 1 else "dp_replicate"


def _phased_reuses(plan: Plan, zero: int) -> str | None:
    """The backbone's mesh dimension whose groups have the ranks of its phased units' DP
    groups (then those are used again, not created twice): its DP dimension on one
    pipeline stage, its PP dimension on one replica; None otherwise (and on a single
    rank, where no group is made at all)."""
    backbone = next(u for u in plan.units if u.role == "backbone")
    if backbone.pp == 1:
        return _phased_dp_dim(zero)
    if backbone.dp == 1:
        return "pp"
    return None


def phased_groups(plan: Plan, unit: str, zero: int = 1) -> tuple[tuple[int, ...], ...]:
    """Every DP group of phased unit ``unit`` that is a group of its own
    (``_phased_reuses``: not one of the backbone's), in tp_index order: the split of the
    default group ``split_group`` makes for it (empty where none is made)."""
    if _phased_reuses(plan, zero) is not None:
        return ()
    grid = phased_grid(plan, plan.unit(unit))
    return tuple(g for g in grid.dp_groups() if len(g) > 1)


def dim_groups(plan: Plan, dim: str, zero: int = 1, replica_dp: int = 1) -> tuple[Any, ...]:
    """Every group of mesh dimension ``dim`` in the job (units in plan order, groups of
    one rank left out): the split of the default group that ``split_group`` makes."""
    if dim not in MESH_DIMS:
        raise ValueError(f"{dim!r} is not a mesh dimension ({', '.join(MESH_DIMS)})")
    out: list[tuple[int, ...]] = []
    for g in grids(plan):
        if unit_mesh_shape(g, zero, replica_dp)[MESH_DIMS.index(dim)] > 1:
            if dim.startswith("dp"):     # each DP group's lines (``_lines``)
                n = shards(g.dp * g.cp, zero, replica_dp)
                out.extend(dp_lines(ranks, n, i)[dim] for ranks in g.dp_groups()
                           for i in (range(n) if dim == "dp_replicate" else
                                     range(0, len(ranks), n)))
            else:
                out.extend({"pp": g.pp_groups, "tp": g.tp_groups}[dim]())
    return tuple(out)


def data_parallel_mesh(mesh: Any) -> Any:
    """The part of a unit's mesh FSDP2 runs over: ``dp_shard`` (ZeRO >= 1, or ZeRO 0
    with one replica), or ``(dp_replicate, dp_shard)`` for ZeRO 0 over several replicas
    (HSDP with shards of one rank). HSDP all-reduces over its replicate dimension even
    when it holds one rank, so a replicate dimension of one is left out: the mesh never
    sends anything over a dimension of one (module docstring)."""
    if mesh["dp_replicate"].size() == 1:
        return mesh["dp_shard"]
    return mesh["dp_replicate", "dp_shard"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ProcessGroups:
    """This rank's place in its unit: the unit's DeviceMesh (``MESH_DIMS``) and its TP
    process group (a placeholder of one rank when tp = 1: module docstring); on a
    backbone rank, each phased encoder's DeviceMesh too (same dimensions, over
    ``phased_grid``), by unit name."""

    role: RankRole
    mesh: Any
    tp: ProcessGroup
    phased: dict[str, Any] = field(default_factory=dict)
    # Context parallelism (cp > 1): the CP group (ring, Ulysses), or for hybrid the
    # ``(cp_ring, cp_ulysses)`` DeviceMesh (``parallel.cp``); None at cp 1.
    cp: Any = None
    # Expert parallelism (ep > 1, ``ExpertGroups``); None at ep 1.
    ep: ExpertGroups | None = None

    @property
    def rank(self) -> int:
        return self.role.rank

    def groups(self) -> dict[str, tuple[int, ...]]:
        """The members of each mesh dimension's group as torch holds them (dimension ->
        global ranks), dimensions of one rank left out: what ``rank_groups`` says."""
        import torch.distributed as dist

        out = {}
        for dim in MESH_DIMS:
            ranks = tuple(dist.get_process_group_ranks(self.mesh.get_group(dim)))
            if len(ranks) > 1:
                out[dim] = ranks
        own = set(out.values())
        out.update(self._cp_groups())
        if self.ep is not None:
            unit = self.role.unit
            for key, group in ((f"{unit}.ep", self.ep.group),
                               (f"{unit}.ep_dp", self.ep.dp_group)):
                ranks = tuple(dist.get_process_group_ranks(group))
                if len(ranks) > 1:
                    out[key] = ranks
        for unit, mesh in self.phased.items():
            for dim in MESH_DIMS:
                ranks = tuple(dist.get_process_group_ranks(mesh.get_group(dim)))
                if len(ranks) > 1 and ranks not in own:
                    out[f"{unit}.{dim}"] = ranks
        return out


    def _cp_groups(self) -> dict[str, tuple[int, ...]]:
        import torch.distributed as dist

        if self.cp is None:
            return {}
        unit = self.role.unit
        if isinstance(self.cp, dist.ProcessGroup):
            return {f"{unit}.cp": tuple(dist.get_process_group_ranks(self.cp))}
        out = {}
        for dim in self.cp.mesh_dim_names:
            ranks = tuple(dist.get_process_group_ranks(self.cp.get_group(dim)))
            if len(ranks) > 1:
                out[f"{unit}.{dim}"] = ranks
        return out


def splits_groups() -> bool:
    """Whether subgroups must be split from the default group (``split_group``, every
    rank of the job taking part) rather than created by their members alone: where the
    default group is bound to a device (NCCL with ``device_id``, as
    ``parallel.device.init_distributed`` binds it), torch builds every new communicator
    with ``ncclCommSplit``, collective over the default group, so a members-only
    ``new_group`` would wait for ranks that never come."""
    from torch.distributed.distributed_c10d import _get_default_group

    return _get_default_group().bound_device_id is not None


def new_subgroup(ranks: Sequence[int] | None, family: Callable[[], Sequence[Sequence[int]]],
                 *, desc: str) -> ProcessGroup | None:
    """This rank's group ``ranks`` of ``family`` (disjoint groups of more than one rank,
    the same on every rank), or None where the rank is in none (``ranks`` None or one
    rank). Split from the default group where ``splits_groups()``: then every rank of the
    job calls it, member or not, in the same order. Elsewhere only the members create it
    (``use_local_synchronization``) and ``family`` is never built."""
    import torch.distributed as dist

    if splits_groups():
        groups = [list(g) for g in family()]
        return dist.split_group(split_ranks=groups, group_desc=desc) if groups else None
    if ranks is None or len(ranks) < 2:
        return None
    return dist.new_group(list(ranks), use_local_synchronization=True, group_desc=desc)


def _alone(rank: int, desc: str) -> ProcessGroup:
    """The group of a mesh dimension this rank is alone on: a group of torch's ``fake``
    backend (how torch's DeviceMesh and torchtitan disable a dimension), which has no
    communicator, socket or peer, set to raise on any collective. FSDP2 and DTensor
    communicate nothing over a dimension of size one (they copy locally), so it is never
    used; if torch ever tried, the run fails instead of reading a buffer no one wrote."""
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")
    from torch._C._distributed_c10d import FakeProcessGroup

    options = FakeProcessGroup.Options()
    options.error_on_collective = True
    return dist.new_group([rank], backend="fake", pg_options=options,
                          use_local_synchronization=True, group_desc=desc)


def build_groups(plan: Plan, *, device_type: str = "cpu", zero: int = 1,
                 ulysses: dict[str, int] | None = None, replica_dp: int = 1) -> ProcessGroups:
    """This rank's groups (``rank_groups``) and its unit's DeviceMesh over them
    (``MESH_DIMS``, the unit's ranks laid out as in the module docstring, TP innermost),
    then its unit's CP group(s) (``ulysses``: the hybrid units' Ulysses degrees,
    ``cp_ulysses``). Only the members of a group create it, except where the default
    group is bound to a device (``splits_groups``): there every rank calls it (once per
    mesh dimension and per CP dimension of each unit with cp > 1). The default group's
    size must equal the plan's ranks, and every rank must have created as many groups
    before (none: call it first)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("build_groups needs torch.distributed to be initialised")
    world = dist.get_world_size()
    if world != _world(plan):
        raise ValueError(f"the plan uses {_world(plan)} ranks but the world size is {world}")
    rank = dist.get_rank()
    role = role_of(plan, rank)
    mine = rank_groups(plan, rank, zero, ulysses, replica_dp)
    groups = []
    for dim in MESH_DIMS:       # the same order on every rank: module docstring
        desc = f"{role.unit}_{dim}"
        group = new_subgroup(mine.get(dim), lambda dim=dim: dim_groups(
            plan, dim, zero, replica_dp), desc=desc)
        if group is None:
            group = _alone(rank, desc)
        elif tuple(dist.get_process_group_ranks(group)) != mine.get(dim):
            raise RuntimeError(f"rank {rank}: the {dim} group holds ranks "
                               f"{dist.get_process_group_ranks(group)}, the plan says "
                               f"{mine.get(dim)}")
        groups.append(group)
    mesh = _mesh(role.grid, groups, device_type, zero, replica_dp)
    cp = _cp_groups(plan, role, mine, device_type, ulysses or {})
    phased = _phased_meshes(plan, role, mesh, device_type, zero)
    return ProcessGroups(role=role, mesh=mesh, tp=mesh.get_group("tp"), phased=phased, cp=cp,
                         ep=_ep_groups(plan, role, mine, device_type, zero, mesh,
                                       replica_dp))


def _ep_groups(plan: Plan, role: RankRole, mine: dict[str, tuple[int, ...]],
               device_type: str, zero: int, mesh: Any = None,
               replica_dp: int = 1) -> ExpertGroups | None:
    """This rank's ``ExpertGroups`` (None at ep 1), made after every other group: each
    unit with ep > 1 in plan order, its EP groups, then its expert DP groups, so that
    where groups are split from the default group every rank of the job takes part in the
    same order. ``mesh``: the unit's DeviceMesh, whose ``tp`` group is the experts'
    mesh's (their TP split's mesh: FSDP2 wants one root for a parameter's DP and TP
    meshes) and, under Local SGD with replicas of several ranks (``replica_dp`` > 1),
    whose ``dp_replicate`` group is too (``ExpertGroups.replicas``)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    made: dict[str, Any] = {}
    for g in grids(plan):
        if plan.unit(g.name).ep == 1:
            continue
        for dim in ("ep", "ep_dp"):
            key = f"{g.name}.{dim}"
            group = new_subgroup(mine.get(key), lambda dim=dim, g=g: _ep_family(
                plan, g.name, dim, replica_dp), desc=f"{g.name}_{dim}")
            if g.name != role.unit:
                continue
            if group is None:
                group = _alone(role.rank, f"{g.name}_{dim}")
            elif tuple(dist.get_process_group_ranks(group)) != mine.get(key):
                raise RuntimeError(f"rank {role.rank}: the {key} group holds ranks "
                                   f"{dist.get_process_group_ranks(group)}, the plan says "
                                   f"{mine.get(key)}")
            made[dim] = group
    if not made:
        return None
    e = plan.unit(role.unit).ep
    replicas = replica_dp > 1 and zero == 0
    span = math.gcd(role.grid.dp, replica_dp) if replicas else role.grid.dp
    tp = mesh["tp"] if mesh is not None else None
    t = role.grid.tp if tp is not None else 1
    # Per replica (one without Local SGD), its ranks holding this rank's experts (the
    # expert DP group of ``ep_lines``), each with its TP group: TP is innermost in a
    # unit's ranks (module docstring).
    dp = role.dp_ranks
    table = torch.tensor([[[dp[k * span + j] - role.tp_index + i for i in range(t)]
                           for j in range(role.replica % e, span, e)]
                          for k in range(role.grid.dp // span)], dtype=torch.int)
    dims = {"pp": _alone(role.rank, f"{role.unit}_ep_pp")}
    if replicas:
        # The replicas at this rank's place (the unit's dp_replicate line), then the
        # replica's own ranks with the same experts.
        dims.update(dp_replicate=mesh["dp_replicate"].get_group(), dp_shard=made["ep_dp"])
        table = table.reshape(1, *table.shape)
    elif zero >= 1:
        dims.update(dp_replicate=_alone(role.rank, f"{role.unit}_ep_dpr"),
                    dp_shard=made["ep_dp"])
        table = table.reshape(1, 1, -1, t)
    else:
        dims.update(dp_replicate=made["ep_dp"],
                    dp_shard=_alone(role.rank, f"{role.unit}_ep_dps"))
        table = table.reshape(1, -1, 1, t)
    dims["tp"] = tp.get_group() if tp is not None and role.grid.tp > 1 \
        else _alone(role.rank, f"{role.unit}_ep_tp")
    mesh = DeviceMesh.from_group([dims[d] for d in MESH_DIMS], device_type, mesh=table,
                                 mesh_dim_names=MESH_DIMS)
    return ExpertGroups(group=made["ep"], mesh=mesh, replicas=replicas)


def _cp_groups(plan: Plan, role: RankRole, mine: dict[str, tuple[int, ...]],
               device_type: str, ulysses: dict[str, int]) -> Any:
    """This rank's CP group (or hybrid mesh, ``ProcessGroups.cp``), made after the mesh's
    groups: every unit with cp > 1 in plan order, so that where groups are split from the
    default group every rank of the job takes part in the same order."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from dtdsl.parallel.cp import MESH_DIMS as CP_DIMS

    out = None
    for g in grids(plan):
        if g.cp == 1:
            continue
        u = ulysses.get(g.name, 1)
        dims = ("cp",) if u in (1, g.cp) else CP_DIMS
        made = []
        for dim in dims:
            key = f"{g.name}.{dim}"
            desc = f"{g.name}_{dim}"
            group = new_subgroup(mine.get(key), lambda dim=dim, g=g, u=u: _cp_family(
                plan, g.name, dim, u), desc=desc)
            if g.name != role.unit:
                continue
            if group is None:
                group = _alone(role.rank, desc)
            elif tuple(dist.get_process_group_ranks(group)) != mine.get(key):
                raise RuntimeError(f"rank {role.rank}: the {key} group holds ranks "
                                   f"{dist.get_process_group_ranks(group)}, the plan says "
                                   f"{mine.get(key)}")
            made.append(group)
        if g.name != role.unit:
            continue
        if dims == ("cp",):
            out = made[0]
        else:
            table = torch.tensor(role.cp_ranks, dtype=torch.int).reshape(g.cp // u, u)
            out = DeviceMesh.from_group(made, device_type, mesh=table, mesh_dim_names=CP_DIMS)
    return out


def _mesh(grid: UnitGrid, groups: list[Any], device_type: str, zero: int,
          replica_dp: int = 1) -> Any:
    """The DeviceMesh of ``grid`` over ``groups`` (one per mesh dimension)."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    table = torch.arange(grid.first_rank, grid.first_rank + grid.size,
                         dtype=torch.int).reshape(unit_mesh_shape(grid, zero, replica_dp))
    return DeviceMesh.from_group(groups, device_type, mesh=table, mesh_dim_names=MESH_DIMS)


def _phased_meshes(plan: Plan, role: RankRole, mesh: Any, device_type: str,
                   zero: int) -> dict[str, Any]:
    """Each phased encoder's DeviceMesh on this rank (``phased_grid``): the backbone's TP
    group, a placeholder for its PP dimension and the DP dimension ZeRO does not use, and
    its DP group: one of the backbone's where it has the same ranks (``_phased_reuses``),
    else a new one, made after the unit's groups by its members (or split from the
    default group by every rank of the job, ``new_subgroup``: so every rank comes here,
    in plan order)."""
    import torch.distributed as dist

    out: dict[str, Any] = {}
    reused = _phased_reuses(plan, zero) if any(u.phased for u in plan.units) else None
    mine = rank_groups(plan, role.rank, zero)
    dp_dim = _phased_dp_dim(zero)
    for u in (u for u in plan.units if u.phased):
        desc = f"{u.name}_{dp_dim}"
        group = None
        if reused is None:
            group = new_subgroup(mine.get(f"{u.name}.{dp_dim}"),
                                 lambda u=u: phased_groups(plan, u.name, zero), desc=desc)
        if role.role != "backbone":
            continue
        own = phased_role(plan, u, role.rank)
        if reused is not None:
            group = mesh.get_group(reused)
        elif group is None:
            group = _alone(role.rank, desc)
        elif tuple(dist.get_process_group_ranks(group)) != own.dp_ranks:
            raise RuntimeError(f"rank {role.rank}: {u.name}'s DP group holds ranks "
                               f"{dist.get_process_group_ranks(group)}, the plan says "
                               f"{own.dp_ranks}")
        groups = {"pp": _alone(role.rank, f"{u.name}_pp"), "tp": mesh.get_group("tp"),
                  dp_dim: group}
        other = "dp_replicate" if dp_dim == "dp_shard" else "dp_shard"
        groups[other] = _alone(role.rank, f"{u.name}_{other}")
        out[u.name] = _mesh(own.grid, [groups[d] for d in MESH_DIMS], device_type, zero)
    return out
