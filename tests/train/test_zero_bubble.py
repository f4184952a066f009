"""The zero-bubble schedule (ZB-H1) in the executor: each backward split into its input
gradients (``B``) and its weight gradients (``W``, ``train.zerobubble``), against the
single-process reference (multi-rank gloo runs)."""

from __future__ import annotations

from dtdsl.ir import program as ir
from dtdsl.ir.plan import Plan
from dtdsl.ir.schedule import ActionKind
from dtdsl.schedule.lower import lower
from tests.helpers.runs import check, plan_for, spec

STEPS = 8


def zero_bubble(program: ir.Program) -> ir.Program:
    """``program`` with ``schedule = zero_bubble``."""
    return program.model_copy(update={"train": program.train.model_copy(
        update={"schedule": "zero_bubble"})})


def zb_plan(plan: Plan) -> Plan:
    return plan.model_copy(update={"schedule": "zero_bubble"})


def test_zero_bubble_backbone_over_two_stages_matches_the_reference():
    program = zero_bubble(spec(8))
    plan = zb_plan(plan_for(program, ("vit", "encoder", 1, 1, 1),
                            ("llm", "backbone", 1, 1, 2), ("gen", "generator", 1, 1, 1)))
    schedule = lower(plan, program)
    for s in (0, 1):
        kinds = [a.kind for a in schedule.stage("llm", s).actions]
        assert kinds.count(ActionKind.W) == kinds.count(ActionKind.B) > 0
    check(program, plan, STEPS)
