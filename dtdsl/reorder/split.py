"""The split without reordering: items cut into contiguous runs, one per group.

Shared by the simulator's routing (``dtdsl.sim.workload``) and the runtime's
(through ``dtdsl.data.batch.route_batch``), so predicted and measured runs route alike.
"""

from __future__ import annotations

__all__ = ["contiguous_split"]


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
