"""Plans laid out by hand as the planner writes them: units co-located on the
backbone's first or last stage, an encoder phased over the backbone's ranks, a unit
interleaved over model chunks, a unit at context parallelism (``with_cp``)."""

from __future__ import annotations

from dtdsl.ir import program as ir
from dtdsl.ir.plan import Plan


def colocate(program: ir.Program, plan: Plan, *names: str,
             split: tuple[int, ...] | None = None) -> Plan:
    """``plan`` with the units ``names`` co-located on the backbone's first (encoder) or
    last (generator) stage, as the planner writes them (``colocated``, ``gpus`` 0, the
    backbone's tp, dp and first rank, one stage of all its layers), the other units laid
    out again on the ranks left; ``split``: the backbone's layers per stage (uneven, as a
    co-located plan balances its stages)."""
    backbone = next(u for u in plan.units if u.role == "backbone")
    if split is not None:
        backbone = backbone.model_copy(update={"layers_per_stage": split})
    units, first = [], 0
    for u in plan.units:
        if u.name in names:
            continue
        u = backbone if u.role == "backbone" else u
        units.append(u.model_copy(update={"first_rank": first}))
        first += u.gpus
    host = next(u for u in units if u.role == "backbone")
    hosted = [u.model_copy(update={
        "colocated": True, "gpus": 0, "tp": host.tp, "dp": host.dp, "pp": 1, "vpp": 1,
        "first_rank": host.first_rank, "microbatch_share": 1.0,
        "layers_per_stage": (program.module(u.name).arch.pipeline_layers,)})
        for u in plan.units if u.name in names]
    order = {u.name: i for i, u in enumerate(plan.units)}
    out = sorted(units + hosted, key=lambda u: order[u.name])
    return plan.model_copy(update={"units": tuple(out), "num_gpus": first, "gpus_used": first})


def phase(program: ir.Program, plan: Plan, name: str = "vit") -> Plan:
    """``plan`` with encoder ``name`` phased over the backbone's ranks, as the planner
    writes it (``UnitPlan.phased``: gpus 0, the backbone's tp and first rank, dp = its
    dp x pp, one stage of all its layers, recomputed, a 1/pp share of a microbatch), the
    other units laid out again on the ranks left."""
    units, first = [], 0
    for u in plan.units:
        if u.name == name:
            continue
        units.append(u.model_copy(update={"first_rank": first}))
        first += u.gpus
    bb = next(u for u in units if u.role == "backbone")
    # Co-located units run on the backbone's ranks.
    units = [u.model_copy(update={"first_rank": bb.first_rank}) if u.colocated else u
             for u in units]
    enc = plan.unit(name).model_copy(update={
        "phased": True, "gpus": 0, "tp": bb.tp, "dp": bb.dp * bb.pp, "pp": 1, "vpp": 1,
        "first_rank": bb.first_rank, "recompute": ir.Recompute.FULL, "microbatch_share": 1 / bb.pp,
        "layers_per_stage": (program.module(name).arch.pipeline_layers,)})
    order = {u.name: i for i, u in enumerate(plan.units)}
    out = sorted([*units, enc], key=lambda u: order[u.name])
    return plan.model_copy(update={"units": tuple(out), "num_gpus": first, "gpus_used": first})


def interleaved(program: ir.Program, vpp: int = 2) -> ir.Program:
    """``program`` with ``schedule = interleaved(virtual_stages=vpp)``."""
    return program.model_copy(update={"train": program.train.model_copy(
        update={"schedule": "interleaved", "virtual_stages": vpp})})


def chunked(plan: Plan, unit: str, vpp: int = 2) -> Plan:
    """``plan`` with ``unit`` interleaved over ``vpp`` model chunks per stage."""
    units = tuple(u.model_copy(update={"vpp": vpp}) if u.name == unit else u
                  for u in plan.units)
    return plan.model_copy(update={"schedule": "interleaved", "units": units})


def with_cp(program: ir.Program, plan: Plan, cp: int, method: str, name: str = "llm"
            ) -> tuple[ir.Program, Plan]:
    """``program`` with ``name``'s ``context_parallel = method`` and ``plan`` with its
    unit at ``cp`` (cp times the GPUs), the units laid out again in order."""
    modules = tuple(m.model_copy(update={"context_parallel": method}) if m.name == name
                    else m for m in program.modules)
    program = program.model_copy(update={"modules": modules})
    units, first = [], 0
    for u in plan.units:
        update: dict = {"first_rank": first}
        if u.name == name:
            update.update(cp=cp, gpus=u.gpus * cp)
        u = u.model_copy(update=update)
        units.append(u)
        first += u.gpus
    return program, plan.model_copy(update={"units": tuple(units), "num_gpus": first,
                                            "gpus_used": first})
