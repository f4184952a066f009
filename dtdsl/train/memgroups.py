"""Stages whose ``dtc memcheck`` replays are the same (``train.memplan.check_memory``).

A replay costs seconds of CPU per stage (every op through FakeTensor's dispatch), and the
middle stages of a backbone pipeline replay the same thing: the same layers (the same
modules, the same shapes), the same activations in, the same microbatches run
(``memplan._ran``: three of them). They differ in how many microbatches they hold in
flight, ``k``, of which the ``k - ran`` not run are held virtually (``InFlight.hold``),
and in their rank, which only names the place of the same shards (replica 0, TP index 0,
the same mesh shapes). One replay under ``memcheck.measure_held_peaks`` then measures them
all, each with its own count held: its own peak, categories and phase, integer for
integer those of replaying it alone (a count of zero adds zero bytes to every snapshot:
a stage that holds none may share the replay of ones that hold some).

What a replay depends on, and how the key below pins it: the unit (its architecture, TP,
DP, CP, EP, recompute, precision, optimizer: the whole unit's, the same for its stages);
its first and last stages (embedding, inputs made from the data, head and loss, tied
embeddings, broker links) are never grouped; the layers held, by whether each is an MoE
layer (``arch.moe.is_moe_layer``: the only per-index difference of a backbone's layers,
``models.transformer``); co-located units (``parallel.mesh.hosted_units``): a stage
hosting any is never grouped; phased encoders (``phased_units``), which every backbone
rank runs alike past the first stage: by name; ``ran``. Not grouped, as not shown
identical: interleaved units (vpp > 1: their forwards cycle over chunks of their own),
encoders and generators (U-Net, DiT), and under ``--every-microbatch`` stages with
different ``k`` (there every microbatch runs: ``ran`` is ``k``, in the key).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dtdsl.ir import program as ir
from dtdsl.ir.plan import Plan

__all__ = ["replay_groups", "replay_key"]


def replay_key(program: ir.Program, plan: Plan, unit: str, stage: int,
               ran: int) -> tuple[Any, ...] | None:
    """What the replay of ``stage`` of ``unit``, which runs ``ran`` microbatches
    (``memplan._ran``), depends on besides its count of held ones (module docstring), or
    None for a stage measured alone."""
    from dtdsl.parallel.mesh import RankRole, grids, hosted_units, phased_units

    u = plan.unit(unit)
    if u.role != "backbone" or u.colocated or u.phased or u.vpp != 1 \
            or not 0 < stage < u.pp - 1:
        return None
    grid = next(g for g in grids(plan) if g.name == unit)
    role = RankRole(rank=grid.rank(stage, 0, 0), grid=grid, stage=stage, replica=0, tp_index=0)
    if hosted_units(plan, role):
        return None
    split = tuple(u.layers_per_stage)
    start = sum(split[:stage])
    arch = program.module(unit).arch
    moe = getattr(arch, "moe", None)
    layers = tuple(moe is not None and bool(moe.is_moe_layer(i))
                   for i in range(start, start + split[stage]))
    return (unit, ran, layers, tuple(p.name for p in phased_units(plan, role)))


def replay_groups(program: ir.Program, plan: Plan, todo: Sequence[tuple[str, int]],
                  ran: Sequence[int]) -> list[tuple[int, ...]]:
    """``todo``'s stages (``(unit, stage)``, each running ``ran`` of its microbatches) as
    groups of their indices, each replayed once, in the order of their first stage; a
    stage of its own where its key is None."""
    groups: dict[Any, list[int]] = {}
    for i, (unit, stage) in enumerate(todo):
        key = replay_key(program, plan, unit, stage, ran[i])
        groups.setdefault(("alone", i) if key is None else key, []).append(i)
    return sorted((tuple(g) for g in groups.values()), key=lambda g: g[0])
