"""Rank 0's run log: metrics and samples written on the training thread, TensorBoard and
the predicted timelines on a background thread that the step never waits for."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from dtdsl import cli
from dtdsl.data.batch import LocalBatches, SyntheticSource
from dtdsl.ir.plan import Plan
from dtdsl.ir.program import Program
from dtdsl.ir.schedule import parse_schedule
from dtdsl.parallel.mesh import role_of
from dtdsl.sim.tensorboard import TimelineWriter
from dtdsl.train import launch
from dtdsl.train.job import load_job

ROOT = Path(__file__).resolve().parents[2]
SLOW_S = 0.4        # one TensorBoard chart, made slow


@pytest.fixture
def run_log(tmp_path, monkeypatch):
    bundle = tmp_path / "bundle"
    assert cli.main(["compile", str(ROOT / "specs" / "tiny_cpu.dt"), "-o", str(bundle),
                     "--synthetic", "--workers", "0"]) == 0
    job = load_job(bundle)
    program = Program.model_validate_json((bundle / job.program_file).read_bytes())
    plan = Plan.model_validate_json((bundle / job.plan_file).read_bytes())
    schedule = parse_schedule((bundle / job.schedule_file).read_text("utf-8"))
    source = SyntheticSource(program)
    slow = TimelineWriter.add_step

    def add_step(self, *args, **kwargs):
        time.sleep(SLOW_S)
        return slow(self, *args, **kwargs)

    monkeypatch.setattr(TimelineWriter, "add_step", add_step)
    (tmp_path / "run").mkdir()
    log = launch._RunLog(tmp_path / "run", plan, program, schedule, source, 0,
                         job.cost.cost_model(program, bundle))
    feed = LocalBatches(program, plan, role_of(plan, 0), source=source,
                        policy=frozenset(job.reorder))
    return log, feed, plan


def _result(step: int) -> dict:
    return {"step": step, "loss": 1.0 / (step + 1), "lm_loss": 0.5, "gen_loss": 0.5,
            "grad_norm": 1.0, "skipped": False, "time_s": 0.01, "data_wait_s": 0.0}


def test_a_step_never_waits_for_tensorboard_and_nothing_is_lost(run_log, tmp_path):
    log, feed, plan = run_log
    steps = 8
    spent = []
    for step in range(steps):
        batch = feed.batch(step)
        # The measured timeline stands in as the step's own prediction: any Timeline does.
        timeline = log.telemetry._predict(step, batch) if step == 0 else last
        last = timeline
        start = time.perf_counter()
        log.step(_result(step), timeline, batch, plan)
        spent.append(time.perf_counter() - start)
    # Each chart takes SLOW_S (twice: measured and predicted); the step took none of it.
    assert max(spent) < SLOW_S / 4, spent
    log.close()
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text()
               .splitlines()]
    assert [m["step"] for m in metrics] == list(range(steps))
    timelines = [json.loads(x) for x in (tmp_path / "run" / "timelines.jsonl").read_text()
                 .splitlines()]
    # Charts that fell behind are skipped, counted, never queued without bound.
    drawn = [t["step"] for t in timelines]
    assert drawn == sorted(drawn) and 0 in drawn
    assert len(drawn) + log.telemetry.skipped == steps
    assert log.telemetry.skipped > 0
    assert log.telemetry.failed is None
