"""Expert parallelism's groups (``parallel.mesh``'s module docstring: EP groups of ``ep``
consecutive DP replicas, expert DP groups of the replicas at the same EP rank, under Local
SGD both inside one replica): the lines a rank is on (``ep_lines``, pure) and what
``parallel.mesh.build_groups`` gives a rank of them (``ExpertGroups``). Split from
``parallel.mesh`` for its length, which names both too and builds the groups."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:   # torch is imported where groups are built: planning tools never pay for it
    from torch.distributed import ProcessGroup

__all__ = ["ExpertGroups", "ep_lines"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ExpertGroups:
    """An MoE backbone rank's expert parallelism (module docstring): ``group``, its EP
    group (the all-to-alls of ``parallel.ep``); ``mesh``, the DeviceMesh (``MESH_DIMS``)
    of its expert DP group, over which FSDP2 shards and reduces its experts."""

    group: ProcessGroup
    mesh: Any
    # Local SGD with replicas of several ranks (``parallel.replicas``): ``mesh``'s
    # ``dp_shard`` is the replica's own ranks holding the same experts (FSDP2 shards them
    # there) and its ``dp_replicate`` the ranks at the same place in the other replicas,
    # which hold the same experts and meet in ``train.local_sgd``'s synchronisation.
    replicas: bool = False

    @property
    def degree(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size(self.group)

    @property
    def dp_group(self) -> ProcessGroup:
        """The expert DP group: ``mesh``'s DP dimension (ZeRO decides which) of its ranks;
        under Local SGD the replica's own (``replicas``)."""
        return self.mesh["dp_replicate" if self.mesh["dp_replicate"].size() > 1
                         and not self.replicas else "dp_shard"].get_group()


def ep_lines(role: Any, ep: int, replica_dp: int = 1) -> dict[str, tuple[int, ...]]:
    """The EP group (``ep``) and the expert DP group (``ep_dp``) through ``role.rank``
    (``role``: a ``parallel.mesh.RankRole``; EP groups of consecutive replicas, module
    docstring); none at ep 1. ``replica_dp`` > 1: Local SGD replicas of that many
    consecutive DP ranks (``parallel.replicas``), each EP group inside one replica and
    the expert DP group the replica's own ranks holding the same experts. ValueError
    where ``ep`` does not divide the unit's dp (a replica's ranks), or the unit has
    context parallelism."""
    if ep == 1:
        return {}
    grid = role.grid
    span = math.gcd(grid.dp, replica_dp) if replica_dp > 1 else grid.dp
    if ep < 1 or span % ep or grid.cp != 1:
        within = f" (Local SGD replicas of {span})" if span != grid.dp else ""
        raise ValueError(f"{role.unit}: expert parallelism {ep} over dp {grid.dp}{within} "
                         f"(cp {grid.cp}); ep must divide dp and a replica's ranks, "
                         "without context parallelism")
    ranks = role.dp_ranks
    first = role.replica - role.replica % ep
    block = role.replica - role.replica % span
    return {"ep": ranks[first:first + ep],
            "ep_dp": ranks[block + role.replica % ep:block + span:ep]}
