"""A zero_bubble plan through ``dtc compile``, launched as a bundle (torchrun, gloo, the
P2P ordering check on): its backbone's backwards split into B and W
(``train.zerobubble``), it trains like the single-process reference."""

from __future__ import annotations

from pathlib import Path

import pytest

from dtdsl import cli
from dtdsl.ir.schedule import ActionKind, parse_schedule
from dtdsl.schedule.validate import validate_nccl
from tests.helpers.bundle import RTOL, SPEC, launch_ok, read_jsonl, reference_losses

STEPS = 8


def zero_bubble_spec(where: Path) -> Path:
    """tiny_cpu with ``schedule = zero_bubble`` and a backbone of two pipeline stages."""
    text = SPEC.read_text()
    for old in ("schedule         = 1f1b", "  tp(*) in {1, 2}\n"):
        assert old in text, old
    spec = where / "tiny_zero_bubble.dt"
    spec.write_text(text.replace("schedule         = 1f1b", "schedule         = zero_bubble")
                    .replace("  tp(*) in {1, 2}\n", "  tp(*) in {1, 2}\n  pp(llm) == 2\n"))
    return spec


@pytest.mark.slow
def test_zero_bubble_bundle_matches_the_reference(tmp_path):
    spec = zero_bubble_spec(tmp_path)
    bundle = tmp_path / "bundle"
    assert cli.main(["compile", str(spec), "-o", str(bundle), "--synthetic",
                     "--workers", "0"]) == 0
    text = "\n".join(line for line in (bundle / "schedule.txt").read_text().splitlines()
                     if not line.startswith("#"))
    schedule = parse_schedule(text)
    assert schedule.name == "zero_bubble" and schedule.unit("llm").pp == 2
    assert any(a.kind is ActionKind.W for a in schedule.stage("llm", 1).actions)
    validate_nccl(schedule)
    run_dir = tmp_path / "run"
    launch_ok(bundle, run_dir, "--steps", str(STEPS), env={"DTDSL_P2P_CHECK": "1"})
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(STEPS))
    for m, ref in zip(metrics, reference_losses(STEPS, spec=spec), strict=True):
        assert m["loss"] == pytest.approx(ref, rel=RTOL)
