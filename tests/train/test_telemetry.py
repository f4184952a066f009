"""Rank 0's run log: metrics and samples written on the training thread, TensorBoard and
the predicted timelines in a child process that the step never waits for."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from dtdsl import cli
from dtdsl.cost.job import job_cost_model
from dtdsl.data.batch import LocalBatches, SyntheticSource, routing_of
from dtdsl.ir.job import load_job
from dtdsl.ir.plan import Plan
from dtdsl.ir.program import Program
from dtdsl.ir.schedule import parse_schedule
from dtdsl.parallel.mesh import role_of
from dtdsl.sim.tensorboard import TimelineWriter
from dtdsl.train import launch

ROOT = Path(__file__).resolve().parents[2]
SLOW_S = 0.4        # one TensorBoard chart, made slow


class _SlowWriter(TimelineWriter):
    """TensorBoard's writer with slow charts, in the telemetry process (importable by name:
    the spawned child unpickles it)."""

    def add_step(self, *args, **kwargs):
        time.sleep(SLOW_S)
        return super().add_step(*args, **kwargs)


class _FailingWriter(TimelineWriter):
    """Fails at its second chart, once; records the process it ran in."""

    def add_step(self, step, *args, **kwargs):
        (Path(self.logdir).parent / f"writer.{os.getpid()}").touch()
        if step >= 1:
            raise OSError(28, "No space left on device")
        return super().add_step(step, *args, **kwargs)


@pytest.fixture
def run_log(tmp_path):
    bundle = tmp_path / "bundle"
    assert cli.main(["compile", str(ROOT / "specs" / "tiny_cpu.dt"), "-o", str(bundle),
                     "--synthetic", "--workers", "0"]) == 0
    job = load_job(bundle)
    program = Program.model_validate_json((bundle / job.program_file).read_bytes())
    plan = Plan.model_validate_json((bundle / job.plan_file).read_bytes())
    schedule = parse_schedule((bundle / job.schedule_file).read_text("utf-8"))
    source = SyntheticSource(program)
    (tmp_path / "run").mkdir()
    cost = job_cost_model(job.cost, program, bundle)

    def make(writer_type):
        return launch._RunLog(tmp_path / "run", plan, program, schedule, source, 0, cost,
                              writer_type=writer_type)

    feed = LocalBatches(program, plan, role_of(plan, 0), source=source,
                        policy=frozenset(job.reorder))
    return make, feed, plan, (cost, program, schedule, source)


def _started(tb: Path, timeout_s: float = 120.0) -> None:
    """Waits until the telemetry process has opened its TensorBoard file: its start
    (a Python importing this module, and so torch) competes for the CPU, which is not
    what is measured."""
    deadline = time.monotonic() + timeout_s
    while not list(tb.glob("events.out.tfevents.*")):
        assert time.monotonic() < deadline, "the telemetry process never started"
        time.sleep(0.05)


def _a_timeline(parts, plan, feed):
    """Any Timeline stands in for the measured ones: the prediction of step 0's."""
    from dtdsl.reorder.workload import WorkModel
    from dtdsl.sim.simulate import Simulator

    cost, program, schedule, source = parts
    return launch._prediction(cost, plan, program, Simulator(schedule), WorkModel(cost), 0,
                              source.sizes(0), routing_of(plan, feed.batch(0).routing))[0]


def _result(step: int) -> dict:
    return {"step": step, "loss": 1.0 / (step + 1), "lm_loss": 0.5, "gen_loss": 0.5,
            "grad_norm": 1.0, "skipped": False, "time_s": 0.01, "data_wait_s": 0.0}


def test_a_step_never_waits_for_tensorboard_and_nothing_is_lost(run_log, tmp_path):
    make, feed, plan, parts = run_log
    log = make(_SlowWriter)
    steps = 8
    spent = []
    timeline = _a_timeline(parts, plan, feed)
    _started(tmp_path / "run" / "tb")
    for step in range(steps):
        batch = feed.batch(step)
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


def test_a_telemetry_failure_is_reported_once_and_the_run_goes_on(run_log, tmp_path, capfd):
    make, feed, plan, parts = run_log
    log = make(_FailingWriter)
    timeline = _a_timeline(parts, plan, feed)
    for step in range(4):
        log.step(_result(step), timeline, feed.batch(step), plan)
    log.close()
    assert log.telemetry.failed == ("telemetry stopped at step 1: OSError(28, 'No space "
                                    "left on device')")
    assert capfd.readouterr().out.count("telemetry stopped") == 1
    # The charts were drawn in a process of their own; the metrics are all there.
    drawn_in = [p.name for p in (tmp_path / "run").glob("writer.*")]
    assert drawn_in and f"writer.{os.getpid()}" not in drawn_in
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) == 4
    timelines = (tmp_path / "run" / "timelines.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in timelines] == [0]


def test_the_telemetry_process_leaves_when_its_trainer_is_gone(tmp_path):
    import multiprocessing
    import threading

    ctx = multiprocessing.get_context("spawn")
    inbox, outbox, charts = ctx.Queue(), ctx.Queue(), ctx.Value("i", 0)
    # A parent pid that is not this process's parent: the trainer died without closing.
    gone = threading.Thread(target=launch._telemetry_main, daemon=True, args=(
        inbox, outbox, charts, -1, tmp_path, None, None, None, 0, None, None))
    gone.start()
    gone.join(timeout=60)
    assert not gone.is_alive(), "the telemetry process waits for a trainer that is gone"
    # It could not start (no plan): reported, not raised.
    kind, text = outbox.get(timeout=10)
    assert kind == "failed" and text.startswith("telemetry could not start")


def test_the_telemetry_process_does_not_import_torch(run_log, tmp_path):
    """Its start is part of every launch (about 1.5 CPU-s for torch alone): the writer, the
    prediction of a charted step and everything it unpickles are torch-free."""
    from tests.helpers.telemetry import TorchWatchingWriter

    make, feed, plan, parts = run_log
    log = make(TorchWatchingWriter)
    timeline = _a_timeline(parts, plan, feed)
    for step in range(2):
        log.step(_result(step), timeline, feed.batch(step), plan)
    log.close()
    assert log.telemetry.failed is None
    assert len((tmp_path / "run" / "timelines.jsonl").read_text().splitlines()) == 2
    assert (tmp_path / "run" / "torch").read_text() == "False"


def test_a_resumed_run_writes_its_plan_at_the_step_it_starts_from(run_log, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, _, plan, (cost, program, schedule, _) = run_log
    run_dir = tmp_path / "run"
    for first_step in (0, 3):
        launch._TelemetryWork(run_dir, plan, program, schedule, first_step, cost).close()
    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"tensors": 0})
    acc.Reload()
    (tag,) = [t for t in acc.Tags()["tensors"] if t.startswith("plan")]
    assert [e.step for e in acc.Tensors(tag)] == [0, 3]
