"""Context parallelism as the executor runs it on a backbone stage or an encoder unit's
(``parallel.cp`` has the attention): the stage's ``CPGroup`` (``attach_cp``, ``cp_group``),
each CP rank's positions and attention context for a microbatch (``cp_inputs``; an encoder
group's, ``encoder_context``), and the encoders' embedding gradients summed over the CP
ranks before the leader sends them (``sum_over_cp``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from dtdsl.ir import program as ir
from dtdsl.ir.layout import SequenceLayout
from dtdsl.ir.plan import Plan
from dtdsl.models.multimodal import cp_document_ids
from dtdsl.parallel.cp import CPContext, CPGroup, padded_length
from dtdsl.parallel.device import to_device
from dtdsl.parallel.mesh import ProcessGroups, RankRole, cp_ulysses
from dtdsl.train.stage import Stage

__all__ = ["attach_cp", "cp_group", "cp_inputs", "encoder_context", "sum_over_cp", "use_cp"]


def cp_inputs(cp: CPGroup, layouts: Sequence[SequenceLayout], width: int,
               device: torch.device) -> tuple[torch.Tensor, CPContext]:
    """Under context parallelism: this CP rank's real positions ``[B, width / cp]`` (its
    rotary embeddings rotate by them) and the microbatch's ``CPContext``, from the
    layouts every CP rank has (no exchange)."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    docs, positions = cp_document_ids(layouts, width)
    if detect_fake_mode() is None:
        return to_device(cp.shard(positions), device), cp.context(docs)
    # ``dtc memcheck``'s fake world: the ids are host metadata the blocks are classified
    # by, so they are made real (the positions stay fake, as the model's inputs).
    with unset_fake_temporarily():
        context = cp.context(cp_document_ids(layouts, width)[0])
    return cp.shard(positions), context


def encoder_context(cp: CPGroup, batch: int, length: int, device: torch.device
                    ) -> tuple[torch.Tensor, CPContext]:
    """An encoder group's ``[batch, length]`` rows under context parallelism: this CP
    rank's real positions ``[length' / cp]`` and the attention context. Each row is one
    image or clip, bidirectional within itself (one document); the padding up to
    ``length'`` (``parallel.cp.padded_length``) is a document of its own, as on the
    backbone, so no real row attends to it."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    full = padded_length(length, cp.size)
    with unset_fake_temporarily():      # host metadata, real under ``dtc memcheck`` too
        docs = torch.zeros(batch, full, dtype=torch.long)
        docs[:, length:] = 1
        context = cp.context(docs)
    positions = cp.shard(torch.arange(length, device=device), dim=0)
    return positions, context


def attach_cp(program: ir.Program, plan: Plan, stage: Stage, groups: ProcessGroups
               ) -> CPGroup | None:
    """The stage's ``CPGroup`` (None at cp 1), also put where its forward reads it
    (``StageState.cp``): a backbone's, or an encoder unit's on its own ranks (a
    generator's is refused at compile time, DT601)."""
    role = groups.role
    if role.grid.cp == 1:
        return None
    if role.role not in ("backbone", "encoder"):
        raise NotImplementedError(f"{role.unit}: context parallelism runs on the backbone "
                                  f"and on encoders, not on a {role.role}; plan it with cp 1")
    cp = cp_group(program, plan, role, groups.cp)
    use_cp(stage.module, cp)
    return cp


def use_cp(module: Any, cp: CPGroup) -> None:
    """Give a stage's root ``module`` its ``CPGroup``: where its forward reads it
    (``StageState.cp``) and its MoE blocks (each sequence's balance statistics are summed
    over the CP ranks, ``models.moe.MoE.sequence_loss``)."""
    from dtdsl.models.moe import moe_blocks

    module.stage_state = replace(module.stage_state, cp=cp)
    for block in moe_blocks(module):
        block.cp = cp


def cp_group(program: ir.Program, plan: Plan, role: RankRole, group: Any) -> CPGroup:
    """``role``'s ``CPGroup`` over ``group`` (``ProcessGroups.cp``: a process group, or
    the hybrid ``(cp_ring, cp_ulysses)`` DeviceMesh)."""
    method = program.module(role.unit).context_parallel
    if method == "hybrid" and isinstance(group, dist.ProcessGroup):
        # A hybrid split of one dimension (all in one node, or one rank per node).
        method = "ulysses" if cp_ulysses(program, plan).get(role.unit, 1) > 1 else "ring"
    return CPGroup(method=method, size=role.grid.cp, rank=role.cp_index, group=group)


def sum_over_cp(grads: Any, cp: CPGroup) -> None:
    """Sum the gradients of the encoders' embeddings over the CP ranks, in place: each
    CP rank's backward reaches the embeddings of the positions it holds only (zeros
    elsewhere), and the leader sends the whole."""
    flat: list[torch.Tensor] = []
    if isinstance(grads, dict):
        for v in grads.values():
            flat.extend(v.values() if isinstance(v, dict) else [v])
    else:
        flat.extend(grads)
    for t in flat:
        if t.numel():
            for group in cp.groups():
                dist.all_reduce(t, group=group)
