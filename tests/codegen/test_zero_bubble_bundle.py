"""A zero_bubble plan through ``dtc compile``, launched as a bundle (torchrun, gloo, the
P2P ordering check on): its backbone's backwards split into B and W
(``train.zerobubble``), it trains like the single-process reference."""

from __future__ import annotations

import pytest

from dtdsl.ir.schedule import ActionKind
from dtdsl.schedule.validate import validate_nccl
from tests.helpers.bundle import (
    RTOL,
    compiled_schedule,
    launch_ok,
    read_jsonl,
    reference_losses,
    two_stage_spec,
)

STEPS = 8


@pytest.mark.slow
def test_zero_bubble_bundle_matches_the_reference(tmp_path):
    spec = two_stage_spec(tmp_path, "zero_bubble")
    bundle = tmp_path / "bundle"
    schedule = compiled_schedule(spec, bundle)
    assert schedule.name == "zero_bubble" and schedule.unit("llm").pp == 2
    assert any(a.kind is ActionKind.W for a in schedule.stage("llm", 1).actions)
    validate_nccl(schedule)
    run_dir = tmp_path / "run"
    launch_ok(bundle, run_dir, "--steps", str(STEPS), env={"DTDSL_P2P_CHECK": "1"})
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(STEPS))
    for m, ref in zip(metrics, reference_losses(STEPS, spec=spec), strict=True):
        assert m["loss"] == pytest.approx(ref, rel=RTOL)
