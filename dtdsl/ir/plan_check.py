"""What makes a plan unusable for a program: the checks ``dtc`` runs on a plan it reads
(``--plan``, edited by hand or from another spec) and the preflight runs on a bundle's
``plan.json`` before any rank starts (torch-free)."""

from __future__ import annotations

import math

from dtdsl.ir.bounds import MAX_CLUSTER_GPUS
from dtdsl.ir.plan import Plan, UnitPlan
from dtdsl.ir.program import Module, ModuleConstraints, Program

__all__ = ["MAX_PLAN_BYTES", "plan_problems"]

# A plan file larger than this is not one: dtc plan's for 1,172 GPUs is some kilobytes.
MAX_PLAN_BYTES = 16 << 20


def plan_problems(the_plan: Plan, program: Program) -> list[str]:
    """What makes a plan (with the spec's unit names) unusable for ``program``: another
    batch, other roles or layer counts, or a layout that does not add up (a plan from
    another spec, or edited by hand)."""
    train = program.train
    out = []
    for name, planned, spec in (("global_batch", the_plan.global_batch, train.global_batch),
                                ("micro_batch", the_plan.micro_batch, train.micro_batch)):
        if planned != spec:
            out.append(f"{name} is {planned}, the spec's is {spec}")
    if the_plan.schedule != train.schedule:
        out.append(f"schedule is {the_plan.schedule}, the spec's is {train.schedule}")
    out += _rank_problems(the_plan)
    backbones = [u for u in the_plan.units if u.role == "backbone"]
    if len(backbones) != 1:
        return out + [f"{len(backbones)} backbone units, not 1"]
    dp_lm = backbones[0].dp
    if dp_lm >= 1 and the_plan.num_microbatches * dp_lm * the_plan.micro_batch != \
            the_plan.global_batch:
        out.append(f"num_microbatches {the_plan.num_microbatches} x backbone dp {dp_lm} x "
                   f"micro_batch {the_plan.micro_batch} is not the global batch "
                   f"{the_plan.global_batch}")
    for u in the_plan.units:
        module = program.module(u.name)
        if u.role != module.role:
            out.append(f"{u.name}: role {u.role} in the plan, {module.role} in the spec")
        if min(u.tp, u.dp, u.pp, u.vpp, u.cp, u.ep) < 1:
            out.append(f"{u.name}: tp, dp, pp, vpp, cp and ep must be at least 1")
            continue
        degrees = _degree_problems(u, module, program.constraints_for(u.name))
        if degrees:
            out += degrees
            continue
        if u.colocated and (u.gpus != 0 or u.role == "backbone"):
            out.append(f"{u.name}: a co-located unit holds no GPU of its own (it runs on "
                       "the backbone's first or last stage)")
        elif u.phased and (u.gpus != 0 or u.role == "backbone"):
            out.append(f"{u.name}: a phased unit holds no GPU of its own (it runs on all "
                       "the backbone's GPUs, before and after its pipeline)")
        elif not (u.colocated or u.phased) and u.gpus != u.tp * u.cp * u.dp * u.pp:
            out.append(f"{u.name}: gpus {u.gpus} is not tp x cp x dp x pp = "
                       f"{u.tp * u.cp * u.dp * u.pp}")
        layers = module.arch.pipeline_layers
        if len(u.layers_per_stage) != u.pp or sum(u.layers_per_stage) != layers or \
                min(u.layers_per_stage, default=0) < 1:
            out.append(f"{u.name}: layers_per_stage {list(u.layers_per_stage)} does not split "
                       f"its {layers} layers over pp {u.pp}")
        if not math.isclose(u.microbatch_share, dp_lm / u.dp, rel_tol=1e-9):
            out.append(f"{u.name}: microbatch_share {u.microbatch_share:g} is not backbone dp "
                       f"/ dp = {dp_lm}/{u.dp}")
        times = (u.fwd_time_s, u.bwd_time_s, u.dp_sync_time_s)
        if not all(math.isfinite(t) and t >= 0 for t in times):
            out.append(f"{u.name}: fwd_time_s, bwd_time_s and dp_sync_time_s must be finite "
                       "and >= 0")
    return out


def _degree_problems(u: UnitPlan, module: Module, allowed: ModuleConstraints) -> list[str]:
    """A unit's degrees against what its module can take and the spec allows (a plan edited
    by hand; ``Plan`` checks their types only): each within the largest cluster, vpp within
    its layers, tp splitting its heads and widths, ep its experts and its dp (without
    context parallelism, ``parallel.ep_groups``), and a unit of GPUs of its own within its
    ``constraints``."""
    degrees = {"tp": u.tp, "dp": u.dp, "pp": u.pp, "cp": u.cp, "ep": u.ep}
    huge = [f"{k} {v}" for k, v in degrees.items() if v > MAX_CLUSTER_GPUS]
    if huge:
        return [f"{u.name}: {', '.join(huge)}: more than the {MAX_CLUSTER_GPUS} GPUs a "
                "cluster can have"]
    out = []
    arch = module.arch
    if u.vpp > arch.pipeline_layers:
        out.append(f"{u.name}: vpp {u.vpp} is more than its {arch.pipeline_layers} layers")
    conflicts = () if u.tp_replicated else arch.tp_conflicts(u.tp)
    if conflicts:
        out.append(f"{u.name}: tp {u.tp} cannot split its {' and '.join(conflicts)}")
    moe = getattr(arch, "moe", None)
    if u.ep > 1 and moe is None:
        out.append(f"{u.name}: ep {u.ep}, but it has no experts")
    elif u.ep > 1:
        if moe.ep_conflicts(u.ep):
            out.append(f"{u.name}: ep {u.ep} cannot split its {moe.experts} experts")
        if u.dp % u.ep or u.cp != 1:
            out.append(f"{u.name}: ep {u.ep} must divide dp {u.dp}, without context "
                       f"parallelism (cp {u.cp})")
    if not (u.colocated or u.phased):
        out += [f"{u.name}: {k} {v} is not one the spec's constraints allow"
                for k, v in degrees.items() if v not in getattr(allowed, k)]
    return out


def _rank_problems(the_plan: Plan) -> list[str]:
    """The units that hold GPUs tile ranks 0..gpus_used-1 back to back (``ir.plan``), within
    the plan's GPUs (and the largest cluster's): a hand-edited count would launch that many
    ranks."""
    if max(the_plan.num_gpus, the_plan.gpus_used) > MAX_CLUSTER_GPUS:
        return [f"num_gpus {the_plan.num_gpus} and gpus_used {the_plan.gpus_used}: a cluster "
                f"has at most {MAX_CLUSTER_GPUS} GPUs"]
    out, at = [], 0
    for u in sorted((u for u in the_plan.units if u.gpus), key=lambda u: u.first_rank):
        if u.first_rank != at:
            out.append(f"{u.name}: first_rank {u.first_rank}, not {at} (the units hold ranks "
                       "back to back from 0)")
        at = max(at, u.first_rank + u.gpus)
    if the_plan.gpus_used != at:
        out.append(f"gpus_used is {the_plan.gpus_used}, its units hold {at} GPUs")
    if the_plan.gpus_used > the_plan.num_gpus:
        out.append(f"gpus_used {the_plan.gpus_used} is more than num_gpus {the_plan.num_gpus}")
    return out
