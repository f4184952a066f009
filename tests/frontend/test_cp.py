"""Context parallelism in the language: the cp(...) axis, context_parallel, DT620/DT621."""

from __future__ import annotations

import pytest

from dtdsl.ir.plan import cp_conflict, cp_split
from dtdsl.ir.program import IntDomain
from tests.helpers.checks import BASE, GENERATOR, diagnostics, errors, program


def _with(text: str, constraints: str, field: str = "") -> str:
    if field:
        text = text.replace("vocab=100, swiglu) }", f"vocab=100, swiglu)\n  {field} }}")
    return text + f"constraints {{ {constraints} }}\n"


def test_cp_defaults_to_one_and_ring():
    p = program(BASE)
    assert all(c.cp == IntDomain(values=(1,)) for c in p.constraints)
    assert p.backbone.context_parallel == "ring"


def test_cp_constraint_and_method_reach_the_program():
    p = program(_with(BASE, "cp(llm) in {1, 2, 4}  cp(vit) == 2", "context_parallel = ulysses"))
    # 8 heads, 2 KV heads: Ulysses 4 splits the heads, the KV heads divide 4.
    assert p.constraints_for("llm").cp == IntDomain(values=(1, 2, 4))
    assert p.constraints_for("vit").cp == IntDomain(values=(2,))
    assert p.backbone.context_parallel == "ulysses"


def test_ring_takes_any_degree():
    p = program(_with(BASE, "cp(llm) in {1, 2, 4, 8, 16}"))
    assert p.constraints_for("llm").cp == IntDomain(values=(1, 2, 4, 8, 16))


def test_unknown_method_is_an_error():
    assert errors(_with(BASE, "cp(llm) == 2", "context_parallel = stripes"))


def test_ulysses_heads_must_divide():
    found = [d for d in diagnostics(_with(BASE, "cp(llm) == 16", "context_parallel = ulysses"))
             if d.severity.value == "error"]
    assert [d.code for d in found] == ["DT621"]
    assert "8 attention heads" in found[0].message and "16" in found[0].message


def test_ulysses_kv_heads_a_multiple_or_divisor():
    # 8 heads, 2 KV heads: Ulysses 4 at tp 1 works; Ulysses 8 at tp 2 has 4 heads a rank.
    assert cp_conflict(program(BASE).backbone.arch, "ulysses", 4, 1, 8) is None
    assert cp_conflict(program(BASE).backbone.arch, "ulysses", 8, 2, 8) is not None


def test_wildcard_cp_drops_what_ulysses_cannot_split_quietly():
    p = program(_with(BASE, "cp(*) in {1, 2, 16}", "context_parallel = ulysses"))
    assert p.constraints_for("llm").cp == IntDomain(values=(1, 2))
    assert p.constraints_for("vit").cp == IntDomain(values=(1, 2, 16))


def test_hybrid_splits_ulysses_inside_a_node():
    assert cp_split("hybrid", 16, 1, 8) == (2, 8)
    assert cp_split("hybrid", 16, 4, 8) == (8, 2)
    assert cp_split("ring", 4, 2, 8) == (4, 1)
    assert cp_split("ulysses", 4, 2, 8) == (1, 4)
    # hybrid at cp 16 puts Ulysses 8 inside a node: 8 heads split, kv 2 divides 8.
    assert program(_with(BASE, "cp(llm) == 16", "context_parallel = hybrid"))


def test_cp_on_a_unet_is_refused():
    text = GENERATOR.replace("MULT", "[1, 2]")
    found = [d for d in diagnostics(text + "constraints { cp(sd) == 2 }\n")
             if d.severity.value == "error"]
    assert [d.code for d in found] == ["DT620"]
    # cp(*) leaves the U-Net at cp 1.
    p = program(text + "constraints { cp(*) in {1, 2} }\n")
    assert p.constraints_for("sd").cp == IntDomain(values=(1,))
    assert p.constraints_for("llm").cp == IntDomain(values=(1, 2))


def test_pinned_gpus_tile_with_cp():
    # 6 = tp 2 x cp 3: not tileable without cp 3 at dp 1, pp 1.
    text = _with(BASE, "gpus(llm) == 6  tp(llm) == 2  pp(llm) == 1  dp(llm) == 1  "
                 "cp(llm) in {1, 3}")
    assert program(text).constraints_for("llm").cp == IntDomain(values=(1, 3))
    assert "DT402" in errors(_with(BASE, "gpus(llm) == 6  tp(llm) == 2  pp(llm) == 1  "
                                   "dp(llm) == 1"))


def test_cp_counts_toward_the_cluster():
    assert "DT402" in errors(_with(BASE, "cp(llm) == 64  tp(llm) == 2"))


@pytest.mark.parametrize("text", ["cp(llm) in {}", "cp(llm) == 0"])
def test_cp_values_are_checked(text):
    assert errors(_with(BASE, text))
