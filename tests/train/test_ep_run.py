"""An MoE backbone under expert parallelism (``parallel.ep`` in the stage), trained by the
runtime against the single-process reference: each MoE block's experts split over an EP
group of consecutive DP replicas, FSDP2 sharding them over the replicas that hold the same
experts, the losses (aux loss included) equal to ``dtc reference``'s."""

from __future__ import annotations

from dtdsl.ir import program as ir
from dtdsl.ir.plan import Plan
from tests.train.test_executor import check, plan_for
from tests.train.test_moe_run import STEPS, moe_spec

ARGS = "experts=4, top_k=2, expert_ffn=64, aux_loss=0.1"


def with_ep(plan: Plan, ep: int) -> Plan:
    """``plan`` with expert parallelism ``ep`` on its backbone."""
    units = tuple(u.model_copy(update={"ep": ep}) if u.role == "backbone" else u
                  for u in plan.units)
    return plan.model_copy(update={"units": units})


def ep_plan(p: ir.Program, dp: int, pp: int, ep: int) -> Plan:
    return with_ep(plan_for(p, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", 1, dp, pp),
                            ("gen", "generator", 1, 1, 1)), ep)


def test_expert_parallel_backbone_matches_the_reference():
    p = moe_spec(args=ARGS)
    check(p, ep_plan(p, 2, 1, 2), steps=STEPS)
