"""Splits of a step's items among groups: without reordering, contiguous runs
(``contiguous_split``); a phased encoder's share of its backbone replica's samples, balanced
by work (``balanced_groups``).

Shared by the simulator's routing (``dtdsl.sim.workload``) and the runtime's
(through ``dtdsl.data.batch.route_batch``), so predicted and measured runs route alike.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

__all__ = ["balanced_groups", "contiguous_split"]


def contiguous_split(n: int, groups: int) -> tuple[int, ...]:
    """The group of each of ``n`` items cut into ``groups`` contiguous runs whose sizes
    differ by at most one (the first ``n % groups`` are the longer)."""
    if groups < 1:
        raise ValueError(f"groups must be at least 1, not {groups}")
    base, extra = divmod(n, groups)
    out: list[int] = []
    for g in range(groups):
        out += [g] * (base + (1 if g < extra else 0))
    return tuple(out)


def balanced_groups(costs: Sequence[float], groups: int) -> tuple[int, ...]:
    """The group of each item, balancing the groups' summed costs: the heaviest item first
    to the group with the least so far (LPT; ties to the earlier item and the lower group),
    within 4/3 of the best split. Deterministic in ``costs``, so ranks that see the same
    costs agree without talking."""
    if groups < 1:
        raise ValueError(f"groups must be at least 1, not {groups}")
    out = [0] * len(costs)
    heap = [(0.0, g) for g in range(groups)]
    for i in sorted(range(len(costs)), key=lambda i: (-float(costs[i]), i)):
        load, g = heapq.heappop(heap)
        out[i] = g
        heapq.heappush(heap, (load + float(costs[i]), g))
    return tuple(out)
