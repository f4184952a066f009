"""What the runtime cannot train yet, as diagnostics of ``dtc compile``.

A spec and its plan can be valid for planning and simulation (``dtc plan``, ``dtc
simulate``) and still need a part the runtime (``dtdsl.train``) does not have. ``dtc
compile`` reports those here, before it writes anything, so a user meets
``file:line:col: error[DT601]`` at compile time rather than a traceback at launch. Each
entry names the missing part and what to write instead; remove an entry when the
runtime learns to run it.

It also refuses a plan whose costs are not what its ranks will see (DT411): a TP group
on ranks of two nodes priced at NVLink bandwidth, as a plan edited by hand can have; and
warns (DT501) of a setting the plan leaves without effect: ``async_tp`` where no unit runs
tensor parallelism.
"""

from __future__ import annotations

from dtdsl.codes import DT411, DT501, DT601, DT622, DT636
from dtdsl.diagnostics import Diagnostic
from dtdsl.ir import program as ir
from dtdsl.ir.plan import Plan, UnitPlan, straddling_tp_groups

__all__ = ["runtime_support", "tp_placement"]

_CODE = DT601


def _encoders(program: ir.Program) -> list[Diagnostic]:
    """Encoders the runtime cannot feed: one that is not a transformer (over patches, or
    over fbank frames: an audio encoder without a patch size reads a frame a token, and
    one of several input channels an fbank per channel, ``ir.modal``), and an image or
    video encoder over other than 3 channels (the data path decodes RGB)."""
    out = []
    for module in program.encoders:
        arch = module.arch
        if not isinstance(arch, ir.TransformerArch):
            out.append(Diagnostic.error(
                _CODE, f"the runtime has no {arch.kind} encoder: '{module.name}' must "
                "be a transformer over patches", module.span,
                hint=f"give {module.name} `arch = transformer(...)`"))
        elif module.modality in ("image", "video") and arch.in_channels not in (None, 3):
            out.append(Diagnostic.error(
                _CODE, f"{module.modality} encoder '{module.name}' reads {arch.in_channels} "
                "channels; the runtime feeds images as 3 RGB channels", module.span,
                notes=["the data path decodes every image and video frame to RGB and "
                       "normalises 3 channels (`models.inputs`)"],
                hint=f"give {module.name} an encoder over 3 channels (`in_channels = 3`, or "
                     "a Hugging Face tower with `num_channels` 3)"))
    return out


def _plan(program: ir.Program, plan: Plan) -> list[Diagnostic]:
    out = []
    if plan.rigid:
        out.append(Diagnostic.error(
            _CODE, "the plan is the Megatron-LM baseline, a layout to compare with: the "
            "runtime does not pad every sequence to seq_len, route by fixed replicas or "
            "recompute where the spec does not ask", program.train.span,
            notes=["`dtc plan --search baseline` prices Megatron-LM's rigid layout; the "
                   "runtime trains the plans of the convex and exhaustive searches, "
                   "co-located ones included"],
            hint="compile without --plan, or with a plan from the convex or exhaustive "
                 "search"))
        return out
    out += _colocated(program, plan) + _phased(program, plan) + _local_sgd_cp(program, plan)
    out += _local_sgd_replicas(program, plan)
    for u in plan.units:
        if u.role == "generator" and u.pp > 1 and \
                not isinstance(program.module(u.name).arch, ir.DiTArch):
            out.append(Diagnostic.error(
                _CODE, f"generator {u.name} is planned on {u.pp} pipeline stages; the runtime "
                "runs a U-Net generator on one stage", program.module(u.name).span,
                notes=["a U-Net's skip connections cross every cut between stages; a DiT "
                       "generator may take several (``train.generator``)"],
                hint=f"constrain it to one stage, `pp({u.name}) == 1` in constraints, and "
                "plan again"))
    return out


def _colocated(program: ir.Program, plan: Plan) -> list[Diagnostic]:
    """A co-located unit runs inside the backbone's first (last) stage, on its TP groups
    and DP replicas (``parallel.mesh.hosted_units``): a hand-edited plan that says
    otherwise, or splits a module over a TP degree that does not divide its heads or
    columns, cannot run. (The planner replicates such a module over the TP group,
    ``tp_replicated``, which runs.)"""
    from dtdsl.parallel.mesh import colocation_problems

    out = []
    for problem in colocation_problems(plan):
        name = problem.partition(":")[0]
        span = program.module(name).span if name in {m.name for m in program.modules} \
            else program.train.span
        out.append(Diagnostic.error(
            _CODE, f"co-located unit {problem}", span,
            notes=["a co-located encoder (generator) runs on the backbone's first (last) "
                   "pipeline stage, with its TP and DP, all its layers in one chunk"],
            hint="compile without --plan, or plan with `dtc plan --placement colocated`"))
    for u in plan.units:
        if u.colocated and u.role != "backbone":
            out += _tp_conflicts(program, u, "co-located")
    out += _shared_backbone(program, plan)
    return out


def _shared_backbone(program: ir.Program, plan: Plan) -> list[Diagnostic]:
    """DT601 for a phased encoder beside another on the backbone's ranks: the backbone's
    first stage runs one phased encoder, or any number of co-located ones (the others,
    units of their own, send it their embeddings)."""
    placed = [u for u in plan.units if u.role == "encoder" and (u.colocated or u.phased)]
    phased = [u for u in placed if u.phased]
    if not phased or len(placed) < 2:
        return []
    other = next(u for u in placed if u is not phased[0])
    kind = "phased" if other.phased else "co-located"
    return [Diagnostic.error(
        _CODE, f"encoder {phased[0].name} is phased and encoder {other.name} is {kind}, "
               "both on the backbone's ranks; the runtime phases an encoder only as the "
               "one encoder there", program.module(phased[0].name).span,
        notes=["the backbone's first stage runs one phased encoder's forward and backward "
               "phases around the pipeline; co-located encoders run inside its passes"],
        hint="plan the other encoders as units of their own or co-located (`dtc plan "
             "--placement colocated`), or compile with a plan that phases one encoder")]


def _tp_conflicts(program: ir.Program, u: UnitPlan, kind: str) -> list[Diagnostic]:
    """DT601 where unit ``u``, run on the backbone's ranks (``kind``: "co-located",
    "phased"), is split by a TP degree that cannot split its heads or columns."""
    conflicts = [] if u.tp_replicated else program.module(u.name).arch.tp_conflicts(u.tp)
    if not conflicts:
        return []
    return [Diagnostic.error(
        _CODE, f"{kind} unit {u.name} is split over the backbone's TP groups of {u.tp}, "
        f"which cannot split its {' and '.join(conflicts)}", program.module(u.name).span,
        notes=["tensor parallelism cuts every attention and MLP block into equal parts"],
        hint=f"mark it `tp_replicated` in the plan (every TP rank then runs all of "
             f"{u.name}), or plan again")]


def _phased(program: ir.Program, plan: Plan) -> list[Diagnostic]:
    """A phased unit is an encoder that runs before and after the backbone's pipeline on
    all its ranks (``parallel.mesh.phased_units``): a phased generator (its loss needs
    the backbone's last hidden states, inside the pipeline), a phased unit beside
    another encoder, or a hand-edited plan that places it otherwise, cannot run; nor can
    a TP split that does not divide it (the planner replicates such a module over the TP
    group, ``tp_replicated``, which runs)."""
    from dtdsl.parallel.mesh import phased_problems

    out = []
    names = {m.name for m in program.modules}
    for problem in phased_problems(plan):
        name = problem.partition(":")[0]
        span = program.module(name).span if name in names else program.train.span
        out.append(Diagnostic.error(
            _CODE, f"phased unit {problem}", span,
            notes=["a phased encoder runs its forward for the whole step before the "
                   "backbone's pipeline and its backward after it, data-parallel over all "
                   "the backbone's GPUs (dp = the backbone's dp x pp, its tp); a generator "
                   "needs the backbone's outputs and cannot run outside the pipeline"],
            hint="compile without --plan, or plan with `dtc plan --placement phased` "
                 "(encoders only)"))
    phased = [u for u in plan.units if u.phased and u.role == "encoder"]
    for u in phased:
        out += _tp_conflicts(program, u, "phased")
    return out


def _context_parallel(program: ir.Program, plan: Plan) -> list[Diagnostic]:
    """Context parallelism runs on the backbone and on an encoder unit of its own ranks
    (``parallel.cp`` in their attention, ``train.executor``): DT601 for a plan that
    splits a generator's sequences or a co-located or phased encoder's (cp > 1: those run
    inside the backbone's stages, whole), DT622 for a cp that the module's heads cannot
    take (a plan read with ``--plan`` need not be the planner's, which refuses those:
    DT621)."""
    from dtdsl.ir.plan import cp_conflict

    out = []
    for u in plan.units:
        if u.cp <= 1:
            continue
        module = program.module(u.name)
        hosted = u.colocated or u.phased
        if u.role == "generator" or hosted:
            what = f"{'co-located' if u.colocated else 'phased'} {u.role}" if hosted \
                else u.role
            out.append(Diagnostic.error(
                _CODE, f"the runtime runs context parallelism on the backbone and on "
                f"encoder units of their own ranks; the plan splits {what} {u.name}'s "
                f"sequences over cp {u.cp} ranks ({module.context_parallel})", module.span,
                notes=["the executor shards the backbone's packed microbatches and an "
                       "encoder unit's patch rows over their CP ranks; a generator's "
                       "tokens, and an encoder run inside the backbone's stages, stay "
                       "whole"],
                hint=f"constrain it, `cp({u.name}) == 1` in constraints, and plan again"))
            continue
        why = cp_conflict(module.arch, module.context_parallel, u.cp, u.tp,
                          program.cluster.gpus_per_node)
        if why is not None:
            out.append(Diagnostic.error(
                DT622, f"{u.name}'s plan splits its sequences over cp {u.cp} ranks "
                f"({module.context_parallel}) at tp {u.tp}, which its attention cannot "
                f"run: {why}", module.span,
                hint=f"plan again (dtc plan never picks it), or use `context_parallel = "
                     f"ring` for {u.name}"))
    return out


def _experts(program: ir.Program, plan: Plan) -> list[Diagnostic]:
    """An MoE backbone with a capacity under context parallelism: an expert's capacity
    counts the tokens of one process, and a CP rank holds a part of each sequence's.
    Expert parallelism (under Local SGD too: ``_local_sgd_replicas``), tensor parallelism
    inside the experts and dropless routing under context parallelism run
    (``parallel.ep``, ``parallel.tp.parallelize_moe`` in ``train.stage``,
    ``models.moe.MoE.cp``)."""
    out = []
    for u in plan.units:
        moe = getattr(program.module(u.name).arch, "moe", None)
        if moe is None or u.cp == 1 or moe.capacity_factor is None:
            continue
        out.append(Diagnostic.error(
            _CODE, f"the runtime does not run context parallelism (cp {u.cp}) with an "
            f"expert capacity for MoE module {u.name} yet", program.module(u.name).span,
            notes=["an expert's capacity is counted over one process's tokens, which under "
                   "context parallelism are a part of each sequence's"],
            hint=f"route dropless (no capacity_factor) or constrain `cp({u.name}) == 1`; "
                 "then plan again"))
    return out


def _local_sgd_cp(program: ir.Program, plan: Plan) -> list[Diagnostic]:
    """Local SGD beside context parallelism: its replicas are a unit's DP ranks, each
    whole (ZeRO-0's mesh); a replica's CP ranks would need FSDP2's reduction among
    themselves, which that mesh does not lay out."""
    if not program.train.sync.local:
        return []
    return [Diagnostic.error(
        _CODE, f"the runtime does not run sync = local_sgd beside context parallelism yet: "
        f"{u.name} has cp {u.cp}", program.train.span,
        notes=["under local_sgd every data-parallel rank is a replica of its own; the CP "
               "ranks of one replica must still sum their gradients every step"],
        hint=f"constrain it, `cp({u.name}) == 1` in constraints, or use sync = allreduce")
        for u in plan.units if u.cp > 1]


def _local_sgd_replicas(program: ir.Program, plan: Plan) -> list[Diagnostic]:
    """``local_sgd(replica_dp=N)``: N must divide every dp > 1, and a unit's ep its
    replica's ranks (``ir.Sync.replica_ranks``: an EP group lies inside one replica)
    (DT636); replicas of
    several ranks are not built beside TP or a phased encoder (DT601: the penalty's norm
    would need one group over a replica's DP and TP ranks; a phased encoder's DP group is
    its own mesh)."""
    sync = program.train.sync
    if not sync.local:
        return []
    out = []
    for u in plan.units:
        if u.ep > 1 and sync.replica_ranks(u.dp) % u.ep:
            out.append(Diagnostic.error(
                DT636, f"{u.name}'s expert parallelism (ep {u.ep}) does not fit in a "
                f"local_sgd replica of {sync.replica_ranks(u.dp)} DP rank(s)",
                program.train.span,
                notes=["an EP group's ranks hold different experts: it must lie inside "
                       "one replica, whose ranks hold a whole model between "
                       "synchronisations"],
                hint=f"use local_sgd(replica_dp=N) with N a multiple of {u.ep} that "
                     f"divides dp({u.name}), or constrain `ep({u.name}) == 1`"))
        if sync.replica_dp == 1:
            continue
        if u.dp > 1 and u.dp % sync.replica_dp:
            out.append(Diagnostic.error(
                DT636, f"local_sgd replica_dp={sync.replica_dp} does not divide {u.name}'s "
                f"dp {u.dp}", program.train.span,
                notes=[f"each replica is {sync.replica_dp} DP ranks; {u.name} would have "
                       f"{u.dp / sync.replica_dp:g} replicas"],
                hint=f"constrain `dp({u.name})` to a multiple of {sync.replica_dp} and plan "
                     "again, or change replica_dp"))
        elif sync.replica_ranks(u.dp) > 1 and (u.tp > 1 or any(v.phased for v in plan.units)):
            what = f"tp {u.tp}" if u.tp > 1 else "a phased encoder"
            out.append(Diagnostic.error(
                _CODE, f"the runtime does not run local_sgd replicas of several ranks "
                f"(replica_dp={sync.replica_dp}) beside {what} yet ({u.name})",
                program.train.span, hint=f"constrain `tp({u.name}) == 1`, plan {u.name} "
                "as its own unit, or use replica_dp=1"))
    return out


def _ranks(group: range) -> str:
    return f"{group[0]}..{group[-1]}"


def _priced_across(unit: UnitPlan, gpus_per_node: int) -> bool:
    # A group larger than a node has always been priced at the network's bandwidth.
    return unit.tp_across_nodes or unit.tp > gpus_per_node


def tp_placement(program: ir.Program, plan: Plan) -> list[Diagnostic]:
    """Errors (DT411) for every unit with a TP group on ranks of two nodes (rank r on node
    r // gpus_per_node, as torchrun numbers them) whose TP collectives the plan priced at
    NVLink bandwidth. Units without collectives of their own (co-located on another's
    ranks, or replicated over the group) have none to misprice."""
    per_node = program.cluster.gpus_per_node
    out = []
    for u in plan.units:
        if u.tp <= 1 or u.tp_replicated or _priced_across(u, per_node):
            continue
        groups = straddling_tp_groups(u, per_node)
        if not groups:
            continue
        first = groups[0]
        names = {m.name for m in program.modules}
        span = program.module(u.name).span if u.name in names else program.cluster.span
        shown = ", ".join(_ranks(g) for g in groups[:4]) + (", ..." if len(groups) > 4 else "")
        out.append(Diagnostic.error(
            DT411, f"{u.name}: its TP group of ranks {_ranks(first)} spans nodes "
            f"{first[0] // per_node} and {first[-1] // per_node} ({per_node} GPUs a node), "
            "but the plan priced its TP collectives at NVLink bandwidth", span,
            notes=[f"{len(groups)} of {u.name}'s {u.dp * u.pp} TP groups (tp {u.tp}, from "
                   f"rank {u.first_rank}) span two nodes: {shown}",
                   "their collectives would cross the network, and the plan's times would "
                   "not be what the run sees"],
            hint="plan again without --plan (dtc plan keeps TP groups within nodes, or "
                 "prices them across)" + (f", or start {u.name} at a rank that is a "
                                          f"multiple of {u.tp}" if per_node % u.tp == 0
                                          else "")))
    return out


def _async_tp(program: ir.Program, plan: Plan) -> list[Diagnostic]:
    """A warning (DT501) for ``train.async_tp`` on a plan that runs no unit at tp > 1: the
    setting overlaps TP collectives, and there are none."""
    if not program.train.async_tp or any(u.tp > 1 and not u.tp_replicated
                                         for u in plan.units):
        return []
    return [Diagnostic.warning(
        DT501, "train.async_tp = true, but no unit of the plan runs tensor parallelism: "
        "there is no TP collective to overlap", program.train.span,
        hint="set async_tp = false, or plan with a tp above 1 for the backbone")]


def runtime_support(program: ir.Program, plan: Plan | None = None) -> list[Diagnostic]:
    """Errors (DT601) for what of ``program`` and ``plan`` the runtime cannot train yet: an
    encoder that is not a transformer over patches, an audio encoder without a patch
    size, and with a plan: a phased encoder beside another on
    the backbone, the baseline's plans, U-Net generators on more than one pipeline stage,
    co-located units placed other than on the backbone's first or last stage and phased
    units other than encoders on all the backbone's ranks (a phased generator), or any of
    these split by a TP degree that does not divide them, encoders and generators with
    context parallelism (cp > 1), and (DT622) a backbone's cp its heads cannot take, an
    MoE backbone with a capacity under cp; (DT636) Local SGD replicas that do not divide
    a unit's dp, or that its EP groups do not fit in; and TP groups across
    nodes priced as within one (``tp_placement``, DT411); and warnings (DT501) for what
    the plan leaves without effect (``_async_tp``).

    Without ``plan`` only the spec's own features are checked (before planning)."""
    out = _encoders(program)
    if plan is not None:
        out += _plan(program, plan) + tp_placement(program, plan) + \
            _context_parallel(program, plan) + _experts(program, plan) + \
            _async_tp(program, plan)
    return out
