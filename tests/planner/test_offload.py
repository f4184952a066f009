"""The planner and the optimizer offload: ``offload=auto`` takes the least fraction of
``OFFLOAD_CHOICES`` with which a layout fits and says so; an explicit one is honoured."""

from __future__ import annotations

import pytest

from dtdsl.cost.model import build_cost_model
from dtdsl.driver import run_frontend
from dtdsl.ir import program as ir
from dtdsl.planner import OFFLOAD_CHOICES, Infeasible, plan
from dtdsl.report import plan_markdown
from tests.specs import TINY

OPTIMIZER = "optimizer        = adamw(lr=1e-3, weight_decay=0.01, zero=1)"


def _program(offload: str, memory_mib: int) -> ir.Program:
    """The tiny spec on one 'GPU' of ``memory_mib`` with short sequences: its optimizer
    state is a large part of what a rank holds."""
    text = TINY.read_text()
    for old, new in ((OPTIMIZER, f"optimizer = adamw(lr=1e-3, zero=1, offload={offload})"),
                     ("gpus          = 4", "gpus          = 1"),
                     ("seq_len          = 512", "seq_len          = 64"),
                     ("global_batch     = 16", "global_batch     = 2"),
                     ("memory=4 GiB", f"memory={memory_mib} MiB")):
        assert old in text, old
        text = text.replace(old, new)
    result = run_frontend("tiny.dt", text.encode())
    assert result.ok, [d.message for d in result.diagnostics]
    return result.program


def _plan(offload: str, memory_mib: int):
    return plan(build_cost_model(_program(offload, memory_mib)), compare_baseline=False,
                placement="colocated")


def test_a_plan_that_fits_only_with_offload():
    assert OFFLOAD_CHOICES == (0.0, 0.25, 0.5, 1.0)
    with pytest.raises(Infeasible):
        _plan("0", 25)
    with pytest.raises(Infeasible):
        _plan("0.5", 25)
    chosen = _plan("auto", 25)
    assert chosen.offload == 1.0 and chosen.offload_chosen
    assert all(u.memory_bytes <= u.memory_limit_bytes for u in chosen.units)
    assert "100% of each rank's optimizer state" in plan_markdown(chosen)
    assert "offload=auto" in plan_markdown(chosen)
    explicit = _plan("1", 25)
    assert explicit.offload == 1.0 and not explicit.offload_chosen
    assert explicit.units == chosen.units


def test_auto_takes_no_offload_where_the_plan_fits_without():
    roomy = _plan("auto", 100)
    assert roomy.offload == 0.0 and roomy.offload_chosen
    assert roomy.units == _plan("0", 100).units
    assert _plan("0", 100).offload == 0.0


def test_auto_says_when_even_all_of_it_on_the_cpu_does_not_fit():
    with pytest.raises(Infeasible) as err:
        _plan("auto", 8)
    assert any("whole optimizer state on the CPU" in n for n in err.value.notes)
