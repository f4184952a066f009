"""``recompute``: none, selective or full per module, and the old true / false."""

from __future__ import annotations

import pytest

from dtdsl.ir.program import Program, Recompute
from tests.helpers.checks import BASE, diagnostics, errors, program

_LLM = "kv_heads=2, vocab=100, swiglu) }"


def _with(value: str) -> str:
    return BASE.replace(_LLM, _LLM[:-2] + f"  recompute = {value} }}")


@pytest.mark.parametrize(("value", "mode"), [
    ("selective", Recompute.SELECTIVE), ("full", Recompute.FULL), ("none", Recompute.NONE),
    ("true", Recompute.FULL), ("false", Recompute.NONE), ('"selective"', Recompute.SELECTIVE)])
def test_recompute_modes_and_the_old_switch(value: str, mode: Recompute):
    p = program(_with(value))
    assert p.module("llm").recompute is mode
    assert p.module("vit").recompute is Recompute.NONE      # the default
    # The program's JSON keeps the mode's name and reads back the same.
    assert Program.model_validate_json(p.model_dump_json()) == p
    assert f'"recompute":"{mode.value}"' in p.model_dump_json()


def test_an_unknown_mode_names_the_choices():
    assert errors(_with("attention")) == ["DT205"]
    [diag] = [d for d in diagnostics(_with("selectve")) if d.severity.value == "error"]
    assert "selective" in (diag.hint or "")
    assert errors(_with("2")) == ["DT206"]


def test_modes_are_ordered_and_only_none_is_false():
    assert [m.rank for m in (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)] == \
        [0, 1, 2]
    assert not Recompute.NONE and Recompute.SELECTIVE and Recompute.FULL
    assert Recompute.of(True) is Recompute.FULL and Recompute.of(False) is Recompute.NONE
    assert Recompute.of("selective") is Recompute.SELECTIVE
