"""Which samples of a global batch each unit replica processes at each microbatch step.

The rule (the same as ``dtdsl.sim.workload.route`` without the ``intra`` / ``inter``
reorder policies), for a global batch of ``B = dp_lm * M * mb`` samples indexed
``0..B-1``, ``M = plan.num_microbatches``, ``mb = plan.micro_batch``:

* backbone replica ``r`` at step ``j`` runs samples ``r*M*mb + j*mb .. r*M*mb + j*mb +
  mb - 1`` (each replica a contiguous run of the batch, cut into microbatches);
* the step's samples are those of all backbone replicas, in increasing index order;
* every other unit cuts the step's samples into ``dp`` contiguous runs whose sizes
  differ by at most one, the first ``n % dp`` runs one longer.

Every rank computes this alike from the plan, so no message is needed to agree on it.
"""

from __future__ import annotations

from dtdsl.ir.plan import Plan
from dtdsl.reorder.split import contiguous_split
from dtdsl.runtime.broker import StepSamples

__all__ = ["contiguous_split", "step_samples"]


def step_samples(plan: Plan, num_samples: int | None = None) -> tuple[StepSamples, ...]:
    """Per microbatch step ``j`` (0..M-1): the step's sample indices (global batch
    positions, increasing) and each unit's replica per sample (module docstring).
    ``num_samples`` (default ``plan.global_batch``) must equal ``dp_lm * M * mb``."""
    m, mb = plan.num_microbatches, plan.micro_batch
    backbone = next(u for u in plan.units if u.role == "backbone")
    n = plan.global_batch if num_samples is None else num_samples
    if n != backbone.dp * m * mb:
        raise ValueError(f"a global batch of {n} samples does not fill backbone dp "
                         f"{backbone.dp} x {m} microbatches x micro_batch {mb} = "
                         f"{backbone.dp * m * mb}")
    out = []
    for j in range(m):
        ids = tuple(r * m * mb + j * mb + i for r in range(backbone.dp) for i in range(mb))
        assignment: dict[str, tuple[int, ...]] = {}
        for u in plan.units:
            if u.name == backbone.name:
                assignment[u.name] = tuple(i // (m * mb) for i in ids)
            else:
                assignment[u.name] = contiguous_split(len(ids), u.dp)
        out.append(StepSamples(sample_ids=ids, assignment=assignment))
    return tuple(out)
