"""Local SGD replicas of several ranks inside a unit's DP group (EDiT's two groups).

Under ``sync = local_sgd(replica_dp=N)`` a unit's ``dp`` DP ranks form ``dp / N`` replicas
of N consecutive DP ranks (consecutive: where DP ranks are laid out node by node, a
replica's FSDP2 traffic stays inside a node, as EDiT puts its model sharding group). A
replica's N ranks are the unit mesh's ``dp_shard`` dimension (EDiT's *model sharding
group*: FSDP2 shards and reduces over it, ``parallel.fsdp.replica_mesh``); the ranks at
the same place in every replica, which hold the same shard, are its ``dp_replicate``
dimension (the *model synchronisation group*: ``train.local_sgd`` averages over it).
``N = 1`` (the default) is every DP rank a whole replica; without Local SGD the ZeRO
stage decides alone (``parallel.mesh.unit_mesh_shape``).
"""

from __future__ import annotations

import math

__all__ = ["dp_lines", "shards"]


def shards(dp: int, zero: int, replica_dp: int = 1) -> int:
    """The ``dp_shard`` size of ``dp`` DP ranks: all of them under ZeRO >= 1; under
    ZeRO 0 (Local SGD's layout, ``ir.Train.mesh_zero``) one replica's ranks
    (``ir.Sync.replica_ranks``: ``replica_dp``, or 1 for a unit of one rank)."""
    return dp if zero >= 1 else math.gcd(dp, replica_dp)


def dp_lines(ranks: tuple[int, ...], n: int, i: int) -> dict[str, tuple[int, ...]]:
    """The ``dp_replicate`` and ``dp_shard`` lines through DP index ``i`` of the DP group
    ``ranks`` split into replicas of ``n`` consecutive ranks."""
    first = i - i % n
    return {"dp_replicate": ranks[i % n::n], "dp_shard": ranks[first:first + n]}
