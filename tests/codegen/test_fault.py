"""A launched bundle survives a SIGKILLed trainer rank and preprocessing worker: torchrun
restarts the job, it resumes from its newest complete checkpoint, and the run ends with the
losses (bitwise) and the samples of an uninterrupted run; ``launch.sh --resume`` carries a
finished run further the same way."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from dtdsl.ir.checkpoint import checkpoint_root, complete_checkpoints, read_manifest
from tests.helpers.bundle import (
    CKPT_EVERY,
    DATASET_SAMPLES,
    SHARED_STEPS,
    consumed,
    launch,
    read_jsonl,
    worker_log,
)

EVERY = CKPT_EVERY  # checkpoint every 2 steps
STEPS = SHARED_STEPS  # 8: an epoch is 3 steps: epochs 0 and 1 whole, 2 begun
KILL = "rank1@5"    # rank 1 (the backbone's first DP replica) dies as step 5 begins
assert (EVERY, STEPS) == (2, 8)


@pytest.fixture(scope="module")
def bundle(tiny_run) -> Path:
    """tiny_cpu with a checkpoint every 2 steps and 2 workers: the shared run's bundle."""
    return tiny_run.bundle


@pytest.fixture(scope="module")
def uninterrupted(tiny_run) -> Path:
    """The uninterrupted run: the shared one (``tests/conftest.py``'s ``tiny_run``, the
    launch-lock tests' first run too: its refused launches change none of its files)."""
    assert tiny_run.returncode == 0, tiny_run.out.read_text()[-3000:]
    return tiny_run.run_dir


def _check_epochs(run_dir: Path) -> None:
    keys = sorted(f"{i:08d}" for i in range(DATASET_SAMPLES))
    for unit in ("vit", "llm", "gen"):
        per_step = consumed(run_dir, unit)
        assert sorted(per_step) == list(range(STEPS)), unit
        for epoch in (0, 1):        # every sample once per epoch, none lost or repeated
            got = [k for step in range(3 * epoch, 3 * epoch + 3) for k in per_step[step]]
            assert sorted(got) == keys, (unit, epoch)


@pytest.mark.slow
def test_a_killed_rank_restarts_the_job_from_its_checkpoint(tmp_path, bundle, uninterrupted):
    want_metrics = read_jsonl(uninterrupted / "metrics.jsonl")
    assert [m["step"] for m in want_metrics] == list(range(STEPS))
    assert [s for s, _ in complete_checkpoints(uninterrupted)] == [4, 6, 8]   # keep 3
    _check_epochs(uninterrupted)

    # A fresh start into a run directory with checkpoints is refused (a copy of the
    # shared run's).
    copy = tmp_path / "uninterrupted"
    shutil.copytree(uninterrupted, copy)
    proc = launch(bundle, copy, "--steps", str(STEPS))
    assert proc.returncode == 2 and "--resume continues it" in proc.stderr

    # Rank 1 and worker 1 are killed; torchrun restarts the trainers (the workers' own
    # supervisor restarts the worker) and they resume.
    run_dir = tmp_path / "killed"
    first = STEPS - EVERY
    proc = launch(bundle, run_dir, "--steps", str(first),
                  env={"DTDSL_FAULT": f"{KILL},worker1@3"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert (run_dir / "faults" / KILL).exists() and (run_dir / "faults" / "worker1@3").exists()
    assert "DTDSL_FAULT: killing rank1 at step 5" in out
    assert "resuming (torchrun restart 1)" in out
    # The newest complete checkpoint when rank 1 died: ckpt-4 if its background save had
    # committed by then, else ckpt-2.
    resumed = re.findall(r"resumed from \S+/ckpt-(\d+) at step (\d+) \(same plan", out)
    assert resumed and resumed[0][0] == resumed[0][1] and int(resumed[0][0]) in (2, 4), out
    log = worker_log(run_dir)
    heard = re.findall(r"the trainers \(session (\w+), ranks [^)]*\) start at step (\d+)", log)
    assert len({session for session, _ in heard}) == 2, log     # the first and the restart
    assert resumed[0][1] in {at for _, at in heard}, log        # followed back to its step
    assert "restarting it" in log
    assert not list(checkpoint_root(run_dir).glob("*.tmp"))

    # launch.sh --resume carries the run on to STEPS (workers and trainers resume).
    proc = launch(bundle, run_dir, "--steps", str(STEPS), "--resume")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert f"resumed from {checkpoint_root(run_dir)}/ckpt-{first} at step {first}" in out
    m = read_manifest(checkpoint_root(run_dir) / f"ckpt-{STEPS}")
    assert (m.step, m.next_step, m.mode) == (STEPS, STEPS, "thread")

    # One line per step, the re-run's, equal to the uninterrupted run: the losses bitwise
    # (same plan, same batches, fp32 on CPU: the same operations in the same order).
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [x["step"] for x in metrics] == list(range(STEPS))
    assert [x["loss"] for x in metrics] == [x["loss"] for x in want_metrics]
    assert [x["grad_norm"] for x in metrics] == [x["grad_norm"] for x in want_metrics]
    assert read_jsonl(run_dir / "samples.jsonl") == read_jsonl(uninterrupted / "samples.jsonl")
    _check_epochs(run_dir)
