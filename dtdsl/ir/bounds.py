"""The largest values a spec may give: the GPUs of a cluster, and per sample its items and
sizes. The checker refuses what is above them (DT208); the cost model's draws are cut at
them, the tail of an unclamped distribution too (``cost.samples.draw``)."""

from __future__ import annotations

from dtdsl.ir.program import Choice, Constant, Empirical, Quantity, Uniform

__all__ = ["MAX_CLUSTER_GPUS", "QUANTITY_LIMITS", "SIZE_LIMIT", "largest", "quantity_limit"]

# The planner's convex solve holds to 2^17 GPUs (at 150k its solver failed on the tiny
# spec): a cluster block's gpus and ``--gpus``.
MAX_CLUSTER_GPUS = 1 << 17
# One sample's items (``count``, ``gen_count``: images, clips, targets) and any size
# (tokens, patches, frames).
QUANTITY_LIMITS = {"count": 4096, "gen_count": 4096}
SIZE_LIMIT = 2**31 - 1


def quantity_limit(quantity: Quantity) -> int:
    """The largest value one sample can have of ``quantity``."""
    return QUANTITY_LIMITS.get(quantity.name, SIZE_LIMIT)


def largest(quantity: Quantity) -> float | None:
    """The largest value ``quantity``'s distribution and clamp allow; None where nothing
    bounds it (a lognormal or zipf without a clamp)."""
    dist = quantity.dist
    top = (dist.value if isinstance(dist, Constant) else
           dist.high if isinstance(dist, Uniform) else
           max(dist.values) if isinstance(dist, (Choice, Empirical)) and dist.values
           else None)
    if quantity.high is not None:
        top = quantity.high if top is None else min(top, quantity.high)
    return top
