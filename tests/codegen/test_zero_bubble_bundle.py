"""A zero_bubble plan through ``dtc compile``, launched as a bundle (torchrun, gloo, the
P2P ordering check on): its backbone's backwards split into B and W
(``train.zerobubble``), it trains like the single-process reference. Its vision projector
compresses (``avg_pool(2)``): the same launch is the compiled bundle of a compressing
projector that trains as ``dtc reference`` does (tests/train/test_compress.py's bundle
test, merged here to share one torchrun launch)."""

from __future__ import annotations

import json

import pytest

from dtdsl import cli
from dtdsl.ir.schedule import ActionKind
from dtdsl.schedule.validate import validate_nccl
from tests.helpers.bundle import (
    RTOL,
    compiled_schedule,
    launch_ok,
    read_jsonl,
    two_stage_spec,
)

# Adam's state through a few updates (8 before the merge; the claims need no more).
STEPS = 4
SHORT = "projector vit -> llm : mlp(depth=2)"


@pytest.mark.slow
def test_zero_bubble_bundle_with_a_compressing_projector_matches_dtc_reference(tmp_path):
    spec = two_stage_spec(tmp_path, "zero_bubble")
    text = spec.read_text()
    assert SHORT in text
    spec.write_text(text.replace(
        SHORT, "projector vit -> llm { arch = mlp(depth=2)  compress = avg_pool(2) }"))
    bundle = tmp_path / "bundle"
    schedule = compiled_schedule(spec, bundle)
    assert schedule.name == "zero_bubble" and schedule.unit("llm").pp == 2
    assert any(a.kind is ActionKind.W for a in schedule.stage("llm", 1).actions)
    validate_nccl(schedule)
    plan = json.loads((bundle / "plan.json").read_text())
    assert plan["gpus_used"] >= 2
    run_dir = tmp_path / "run"
    launch_ok(bundle, run_dir, "--steps", str(STEPS), env={"DTDSL_P2P_CHECK": "1"})
    ref = tmp_path / "reference.jsonl"
    assert cli.main(["reference", str(spec), "--steps", str(STEPS), "--out", str(ref)]) == 0
    want = [r["loss"] for r in read_jsonl(ref)]
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(STEPS))
    assert len(want) == STEPS
    assert [m["loss"] for m in metrics] == pytest.approx(want, rel=RTOL)
