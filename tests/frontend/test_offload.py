"""``optimizer = adamw(..., offload=F)`` and the cluster's ``host_bw``: what the checker
makes of them, DT635 for a fraction outside [0, 1], and old Programs still read."""

from __future__ import annotations

import json

import pytest

from dtdsl.driver import run_frontend
from dtdsl.ir import program as ir
from dtdsl.ir.hardware import HOST_BW_BYTES_PER_S
from tests.specs import TINY

OPTIMIZER = "optimizer        = adamw(lr=1e-3, weight_decay=0.01, zero=1)"


def _check(optimizer_args: str = "", cluster_extra: str = ""):
    text = TINY.read_text()
    assert OPTIMIZER in text
    text = text.replace(OPTIMIZER, f"optimizer = adamw(lr=1e-3, zero=1{optimizer_args})")
    text = text.replace("cpu_workers   = 2", f"cpu_workers   = 2\n  {cluster_extra}")
    return run_frontend("spec.dt", text.encode())


@pytest.mark.parametrize(("arg", "want"), [
    ("", 0.0), (", offload=0.5", 0.5), (", offload=1", 1.0), (", offload=0", 0.0),
    (", offload=auto", "auto"),
])
def test_offload_checks(arg, want):
    result = _check(arg)
    assert result.ok, [d.message for d in result.diagnostics]
    program = result.program
    assert program.train.optimizer.offload == want
    assert ir.Program.model_validate_json(program.model_dump_json()) == program


@pytest.mark.parametrize("value", ["1.5", "-0.25", "2e3", "nan"])
def test_a_fraction_outside_0_1_is_DT635(value):
    result = _check(f", offload={value}")
    (d,) = [d for d in result.diagnostics if d.severity == "error"]
    assert d.code == "DT635" and value in d.message.lower() and "between 0" in d.message, d
    assert "offload=" in (d.hint or "")


def test_offload_of_the_wrong_kind_is_a_type_error():
    (d,) = _check(', offload="half"').diagnostics
    assert d.code == "DT206" and "a fraction between 0 and 1, or auto" in d.message


def test_the_ir_refuses_a_bad_fraction():
    with pytest.raises(ValueError, match="offload 2.0"):
        ir.Optimizer(offload=2.0)
    with pytest.raises(ValueError):
        ir.Optimizer(offload=float("nan"))


def test_host_bw_defaults_to_pcie_gen5_and_can_be_set():
    program = _check().program
    assert program.cluster.host_bw_bytes_per_s == HOST_BW_BYTES_PER_S == 55e9
    program = _check(cluster_extra="host_bw = 25 GB/s").program
    assert program.cluster.host_bw_bytes_per_s == 25e9


def test_programs_written_before_offload_still_read():
    program = _check().program
    data = json.loads(program.model_dump_json())
    del data["train"]["optimizer"]["offload"]
    del data["cluster"]["host_bw_bytes_per_s"]
    old = ir.Program.model_validate(data)
    assert old.train.optimizer.offload == 0.0
    assert old.cluster.host_bw_bytes_per_s == HOST_BW_BYTES_PER_S
