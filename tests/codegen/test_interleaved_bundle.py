"""An interleaved plan through ``dtc compile`` (whose schedule keeps NCCL's rules,
``schedule.validate.validate_nccl``), launched as a bundle (torchrun, gloo, the P2P
ordering check on): it trains like the single-process reference."""

from __future__ import annotations

from pathlib import Path

import pytest

from dtdsl import cli
from dtdsl.ir.schedule import parse_schedule
from dtdsl.schedule.validate import validate_nccl
from tests.helpers.bundle import RTOL, SPEC, launch_ok, read_jsonl, reference_losses

STEPS = 8


def interleaved_spec(where: Path) -> Path:
    """tiny_cpu with ``schedule = interleaved(virtual_stages=2)`` and a backbone of two
    pipeline stages."""
    text = SPEC.read_text()
    for old in ("schedule         = 1f1b", "  tp(*) in {1, 2}\n"):
        assert old in text, old
    spec = where / "tiny_interleaved.dt"
    spec.write_text(text.replace("schedule         = 1f1b",
                                 "schedule         = interleaved(virtual_stages=2)")
                    .replace("  tp(*) in {1, 2}\n", "  tp(*) in {1, 2}\n  pp(llm) == 2\n"))
    return spec


@pytest.mark.slow
def test_interleaved_bundle_matches_the_reference(tmp_path):
    spec = interleaved_spec(tmp_path)
    bundle = tmp_path / "bundle"
    assert cli.main(["compile", str(spec), "-o", str(bundle), "--synthetic",
                     "--workers", "0"]) == 0
    text = "\n".join(line for line in (bundle / "schedule.txt").read_text().splitlines()
                     if not line.startswith("#"))
    schedule = parse_schedule(text)
    llm = schedule.unit("llm")
    assert (llm.pp, llm.vpp) == (2, 2)
    validate_nccl(schedule)
    run_dir = tmp_path / "run"
    launch_ok(bundle, run_dir, "--steps", str(STEPS), env={"DTDSL_P2P_CHECK": "1"})
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(STEPS))
    for m, ref in zip(metrics, reference_losses(STEPS, spec=spec), strict=True):
        assert m["loss"] == pytest.approx(ref, rel=RTOL)
