"""Mixture of experts in the language: transformer(experts=...), the ep(...) axis,
DT640-DT645."""

from __future__ import annotations

import pytest

from dtdsl.ir.plan import UnitPlan
from dtdsl.ir.program import IntDomain, MoEArch, Program
from tests.helpers.checks import BASE, diagnostics, program

MOE = BASE.replace("vocab=100, swiglu)",
                   "vocab=100, swiglu, experts=8, top_k=2, expert_ffn=64)")


def _codes(text: str) -> list[str]:
    return [d.code for d in diagnostics(text) if d.severity.value == "error"]


def test_moe_arguments_reach_the_program():
    p = program(MOE.replace("top_k=2", "top_k=3, shared_experts=2, capacity=1.25, "
                            "moe_every=2, aux_loss=0.01, norm_topk=false"))
    moe = p.backbone.arch.moe
    assert moe == MoEArch(experts=8, top_k=3, ffn=64, shared_ffn=128, norm_topk=False,
                          capacity_factor=1.25, every=2, aux_loss_coef=0.01)
    assert [moe.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert moe.num_moe_layers(p.backbone.arch.layers) == 4
    assert Program.model_validate_json(p.model_dump_json()) == p


def test_moe_defaults_follow_transformers():
    moe = program(BASE.replace("swiglu)", "swiglu, experts=4)")).backbone.arch.moe
    # Mixtral's num_experts_per_tok, router_aux_loss_coef; the MLP's ffn per expert.
    assert (moe.top_k, moe.aux_loss_coef, moe.ffn, moe.norm_topk, moe.every) == \
        (2, 0.001, 512, True, 1)
    assert moe.capacity_factor is None and moe.shared_ffn == 0
    assert program(BASE).backbone.arch.moe is None
    # One expert: top_k defaults to what there is.
    assert program(BASE.replace("swiglu)", "swiglu, experts=1)")).backbone.arch.moe.top_k == 1


def test_moe_arguments_without_experts():
    found = [d for d in diagnostics(BASE.replace("swiglu)", "swiglu, top_k=2)"))
             if d.severity.value == "error"]
    assert [d.code for d in found] == ["DT640"] and "top_k" in found[0].message


def test_experts_off_the_backbone():
    assert _codes(BASE.replace("patch=8)", "patch=8, experts=4)")) == ["DT640"]


def test_top_k_above_experts():
    found = [d for d in diagnostics(MOE.replace("top_k=2", "top_k=9"))
             if d.severity.value == "error"]
    assert [d.code for d in found] == ["DT641"]
    assert "top_k=9" in found[0].message and "8 experts" in found[0].message


def test_moe_every_above_layers():
    assert _codes(MOE.replace("top_k=2", "top_k=2, moe_every=9")) == ["DT642"]
    assert program(MOE.replace("top_k=2", "top_k=2, moe_every=8"))


def test_ep_defaults_to_one():
    p = program(MOE)
    assert all(c.ep == IntDomain(values=(1,)) for c in p.constraints)


def test_ep_constraint_reaches_the_program():
    p = program(MOE + "constraints { ep(llm) in {1, 2, 4} }\n")
    assert p.constraints_for("llm").ep == IntDomain(values=(1, 2, 4))


def test_ep_on_a_dense_module():
    found = [d for d in diagnostics(BASE + "constraints { ep(llm) == 2 }\n")
             if d.severity.value == "error"]
    assert [d.code for d in found] == ["DT643"] and "dense" in found[0].message
    assert _codes(MOE + "constraints { ep(vit) == 2 }\n") == ["DT643"]


def test_ep_must_divide_the_experts():
    found = [d for d in diagnostics(MOE + "constraints { ep(llm) == 3 }\n")
             if d.severity.value == "error"]
    assert [d.code for d in found] == ["DT644"]
    assert "8 experts" in found[0].message and "1, 2, 4, 8" in found[0].hint


def test_ep_must_fit_in_dp():
    assert _codes(MOE + "constraints { ep(llm) == 4  dp(llm) == 2 }\n") == ["DT645"]
    p = program(MOE + "constraints { ep(llm) == 2  dp(llm) == 4 }\n")
    assert p.constraints_for("llm").ep == IntDomain(values=(2,))


def test_wildcard_ep_drops_what_cannot_split_quietly():
    p = program(MOE + "constraints { ep(*) in {1, 2, 3, 16} }\n")
    assert p.constraints_for("llm").ep == IntDomain(values=(1, 2))
    assert p.constraints_for("vit").ep == IntDomain(values=(1,))
    assert not [d for d in diagnostics(MOE + "constraints { ep(*) in {1, 2, 3} }\n")]


def test_tp_must_split_the_experts():
    text = MOE.replace("expert_ffn=64", "expert_ffn=66")
    found = [d for d in diagnostics(text + "constraints { tp(llm) == 4 }\n")
             if d.severity.value == "error"]
    assert [d.code for d in found] == ["DT401"] and "66" in found[0].message


def test_unknown_axis_lists_ep():
    found = [d for d in diagnostics(MOE + "constraints { eq(llm) == 2 }\n")
             if d.severity.value == "error"]
    assert [d.code for d in found] == ["DT205"] and "ep," in found[0].notes[0]


@pytest.mark.parametrize("plan_ep", [None, 2])
def test_unit_plan_reads_without_ep(plan_ep):
    fields = dict(name="llm", role="backbone", projectors=(), gpus=4, tp=1, dp=4, pp=1,
                  first_rank=0, layers_per_stage=(8,), microbatch_share=1.0, fwd_time_s=1.0,
                  bwd_time_s=1.0, dp_sync_time_s=0.0, memory_bytes=1.0,
                  memory_limit_bytes=2.0)
    if plan_ep is not None:
        fields["ep"] = plan_ep
    unit = UnitPlan(**fields)
    assert unit.ep == (plan_ep or 1)
    assert UnitPlan.model_validate_json(unit.model_dump_json()) == unit
