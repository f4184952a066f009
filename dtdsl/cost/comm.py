"""What of a backbone's TP collectives async TP leaves exposed (``train.async_tp``).

Torch's micro-pipelined TP (``parallel.tp.enable_async_tp``) splits each all-gather before
a matmul, and each reduce-scatter after one, into one chunk per TP rank over symmetric
memory: the matmul of the chunk at hand runs while the next chunk moves. So a pass's TP
collectives hide behind its matmuls, except one chunk's transfer of each, which nothing
runs beside (the first chunk of an all-gather, the last of a reduce-scatter): of a pass's
``comm`` seconds, at least ``comm / tp`` stays exposed, and all that its matmuls cannot
cover. Only a sequence-parallel unit (the backbone) has those all-gathers and
reduce-scatters; the other units' TP all-reduces stay as they are. The rule is the same
for dtdsl's plans and the Megatron-LM baselines (Megatron-LM's ``--tp-comm-overlap``
pipelines its TP collectives the same way).
"""

from __future__ import annotations

__all__ = ["async_tp_exposed_s"]


def async_tp_exposed_s(comm_s: float, matmul_s: float, tp: int) -> float:
    """Of ``comm_s`` seconds of one pass's TP collectives beside ``matmul_s`` seconds of
    its matmuls, what stays exposed under async TP (module docstring)."""
    if tp <= 1 or comm_s <= 0:
        return comm_s
    return max(comm_s / tp, comm_s - matmul_s)
