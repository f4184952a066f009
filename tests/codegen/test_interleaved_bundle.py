"""An interleaved plan through ``dtc compile`` (whose schedule keeps NCCL's rules,
``schedule.validate.validate_nccl``), launched as a bundle (torchrun, gloo, the P2P
ordering check on): it trains like the single-process reference."""

from __future__ import annotations

import pytest

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
def test_interleaved_bundle_matches_the_reference(tmp_path):
    spec = two_stage_spec(tmp_path, "interleaved(virtual_stages=2)")
    bundle = tmp_path / "bundle"
    schedule = compiled_schedule(spec, bundle)
    llm = schedule.unit("llm")
    assert (llm.pp, llm.vpp) == (2, 2)
    validate_nccl(schedule)
    run_dir = tmp_path / "run"
    launch_ok(bundle, run_dir, "--steps", str(STEPS), env={"DTDSL_P2P_CHECK": "1"})
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(STEPS))
    for m, ref in zip(metrics, reference_losses(STEPS, spec=spec), strict=True):
        assert m["loss"] == pytest.approx(ref, rel=RTOL)
