"""One launch at a time on a run directory (``train.rundir``), and nothing of an earlier
run emptied: the lock's rules in one process, then launched bundles: a second launch on a
directory in use is refused with one line and leaves the first's files alone, and a rerun
without --resume never empties an earlier run's metrics."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dtdsl import cli
from dtdsl.ir.checkpoint import checkpoint_root, complete_checkpoints
from dtdsl.train.rundir import (
    LOCK_FILE,
    NODES_DIR,
    STALE_S,
    RunDirBusy,
    RunDirLock,
    check_launch_id,
)
from tests.helpers.bundle import (
    SHARED_STEPS,
    TinyRun,
    launch,
    launch_in_background,
    launch_ok,
    on_two_ranks,
    read_jsonl,
    run_files,
    wait_for_output,
)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# ---- the lock's rules (one process: flock locks of separate opens conflict) ---------------

def test_a_second_launch_is_refused_and_the_nodes_of_one_launch_share_the_lock(tmp_path):
    run_dir = tmp_path / "run"
    first = RunDirLock(run_dir, "job-1", host="nodeA", pid=os.getpid())
    first.acquire()
    assert first.first
    other = RunDirLock(run_dir, "job-2", host="nodeA", pid=os.getpid())
    with pytest.raises(RunDirBusy) as refused:
        other.acquire(join_s=0.3)
    said = str(refused.value)
    assert "\n" not in said
    assert f"{run_dir} is in use by launch job-1 (host nodeA, pid {os.getpid()}" in said
    assert said.endswith("wait for it to end, or choose another --run-dir")
    # another node of the same launch joins (and is not its first)
    node2 = RunDirLock(run_dir, "job-1", host="nodeB", pid=os.getpid() + 1)
    node2.acquire()
    assert not node2.first
    assert sorted(p.name for p in (run_dir / NODES_DIR).iterdir()) == \
        [f"nodeA-{os.getpid()}", f"nodeB-{os.getpid() + 1}"]
    first.release()
    with pytest.raises(RunDirBusy, match="in use by launch job-1"):
        other.acquire(join_s=0.3)       # node B still holds it
    node2.release()
    other.acquire()                     # all of job-1 gone: job-2 takes it
    assert other.first
    assert json.loads((run_dir / LOCK_FILE).read_text())["launch"] == "job-2"
    other.release()
    assert not list((run_dir / NODES_DIR).iterdir())


def test_a_node_of_another_host_heard_from_lately_holds_it_whatever_flock_says(tmp_path):
    """A file system whose flock is local to each host cannot show a holder on another
    host: that node's file, touched within STALE_S, refuses the lock; an older one is a
    launch that ended without its exit, and is removed."""
    run_dir = tmp_path / "run"
    nodes = run_dir / NODES_DIR
    nodes.mkdir(parents=True)
    far = nodes / "nodeZ-77"
    far.write_text(json.dumps({"launch": "job-9", "host": "nodeZ", "pid": 77,
                               "started": time.time()}))
    mine = RunDirLock(run_dir, "job-1", host="nodeA")
    with pytest.raises(RunDirBusy, match=r"launch job-9 \(host nodeZ, pid 77, .*heard from "
                                         r"within the last 60 s"):
        mine.acquire(join_s=0.1)
    old = time.time() - STALE_S - 5
    os.utime(far, (old, old))
    mine.acquire()
    assert not far.exists()
    mine.release()


def test_a_dead_launch_on_this_host_is_no_holder_but_its_live_processes_are(tmp_path):
    run_dir = tmp_path / "run"
    dead = _dead_pid()
    gone = RunDirLock(run_dir, "job-1", pid=dead)
    gone.acquire()                  # its descriptor open: processes it started live on
    with pytest.raises(RunDirBusy, match=f"pid {dead}.*its supervisor has exited but "
                                         "processes it started still hold"):
        RunDirLock(run_dir, "job-2").acquire(join_s=0.2)
    assert gone.fd is not None
    os.close(gone.fd)               # they end too, without a word: its node file stays
    assert gone.node.exists()
    later = RunDirLock(run_dir, "job-2")
    later.acquire()                 # a node file of a dead pid on this host is no holder
    assert later.first and not gone.node.exists()
    later.release()


def test_launch_ids_name_files_so_they_are_checked():
    assert check_launch_id("slurm-1234") == "slurm-1234"
    for bad in ("", "../x", "a/b", "-x", "x" * 129, "a b"):
        with pytest.raises(ValueError, match="DTDSL_LAUNCH_ID"):
            check_launch_id(bad)


def test_a_start_at_step_0_sets_an_earlier_runs_records_aside(tmp_path, capsys):
    from dtdsl.train.launch import _set_aside_records

    run_dir = tmp_path / "run"
    (run_dir / "tb").mkdir(parents=True)
    (run_dir / "tb" / "events.out.tfevents.1").write_bytes(b"x")
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    (run_dir / "samples.jsonl").write_text("")
    _set_aside_records(run_dir)
    aside = [p for p in run_dir.iterdir() if p.name.startswith("replaced-")]
    assert len(aside) == 1
    assert (aside[0] / "metrics.jsonl").read_text() == '{"step": 0}\n'
    assert (aside[0] / "tb" / "events.out.tfevents.1").exists()
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "tb").exists()
    assert (run_dir / "samples.jsonl").exists()         # empty: nothing to keep
    assert "moved to" in capsys.readouterr().out
    (run_dir / "metrics.jsonl").write_text('{"step": 5}\n')
    _set_aside_records(run_dir)                         # the same second: its own name
    assert len([p for p in run_dir.iterdir() if p.name.startswith("replaced-")]) == 2


# ---- launched bundles ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def first_run(tiny_run) -> TinyRun:
    """The shared run (``tests/conftest.py``'s ``tiny_run``, test_fault's uninterrupted
    run too): 8 steps (ckpt-4, ckpt-6, ckpt-8 kept of every 2nd); at its step 1 a fresh
    start and a resume on its run directory. The rerun test starts from a copy of it."""
    assert SHARED_STEPS == 8
    return tiny_run


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, tiny_run) -> Path:
    """The shared run's bundle on 2 ranks and 1 worker (its layout at DP 2), for the
    launches of the tests below: their claims (a run directory's records, a signal's
    handling) are the launch's and every rank's alike, 4 ranks add nothing to them."""
    where = tmp_path_factory.mktemp("two")
    spec = where / "tiny_ckpt.dt"
    spec.write_text(on_two_ranks(tiny_run.spec.read_text()))
    out = where / "bundle"
    assert cli.main(["compile", str(spec), "-o", str(out), "--data", str(tiny_run.dataset),
                     "--workers", "1"]) == 0
    return out


@pytest.mark.slow
def test_two_launches_on_one_run_directory(first_run):
    run_dir = first_run.run_dir
    # A fresh start and a resume, both refused at once with one line.
    for proc in first_run.refused:
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert proc.stdout == ""
        lines = proc.stderr.splitlines()
        assert len(lines) == 1 and f"{run_dir} is in use by launch " in lines[0] and \
            f"pid {first_run.pid}" in lines[0], proc.stderr
    assert first_run.returncode == 0, first_run.out.read_text()[-3000:]
    after = run_files(run_dir)
    # the first run's files went on untouched by the refused ones: what it had then is
    # there still (metrics and samples grew by lines)
    for name, data in first_run.before.items():
        if name.endswith(".jsonl"):
            assert after[name].startswith(data), name
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == list(range(8))
    assert [s for s, _ in complete_checkpoints(run_dir)] == [4, 6, 8]   # keep 3
    assert not [p for p in run_dir.iterdir() if "replaced" in p.name]
    assert [p.name for p in (run_dir / "launches").iterdir()] != []


@pytest.mark.slow
def test_a_rerun_without_resume_never_empties_the_earlier_metrics(tmp_path, two_ranks,
                                                                   first_run):
    # A copy of first_run's directory (a launch fewer than a run of its own), left as a
    # run stopped before its first checkpoint leaves it; the launches on it are
    # two_ranks's (without a checkpoint nothing ties the directory to one bundle).
    bundle = two_ranks
    run_dir = tmp_path / "run"
    shutil.copytree(first_run.run_dir, run_dir)
    assert [s for s, _ in complete_checkpoints(run_dir)] == [4, 6, 8]
    shutil.rmtree(checkpoint_root(run_dir))
    earlier = (run_dir / "metrics.jsonl").read_bytes()
    assert len(earlier.splitlines()) == 8 and not complete_checkpoints(run_dir)
    proc = launch(bundle, run_dir, "--steps", "1", timeout=60)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [
        f"launch.sh: {run_dir} holds the records of an earlier run (metrics.jsonl, "
        "samples.jsonl, timelines.jsonl, tb/; no checkpoint): --resume starts it again at "
        "step 0 and sets them aside (replaced-<time>/); or choose another --run-dir"]
    assert (run_dir / "metrics.jsonl").read_bytes() == earlier
    # --resume without a checkpoint starts at step 0, the earlier lines set aside
    proc = launch_ok(bundle, run_dir, "--steps", "1", "--resume")
    assert "a start at step 0: the records of an earlier run moved to" in proc.stdout
    aside = [p for p in run_dir.iterdir() if p.name.startswith("replaced-")]
    assert len(aside) == 1 and (aside[0] / "metrics.jsonl").read_bytes() == earlier
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [0]
    # a checkpoint after its last step, off the every-2-steps cadence (the shared run's
    # last step, 8, is on it)
    assert [s for s, _ in complete_checkpoints(run_dir)] == [1]


@pytest.mark.slow
def test_a_signal_stops_the_run_after_its_checkpoint_in_flight_commits(tmp_path, two_ranks):
    """SIGTERM (Slurm's time limit, a Ctrl-C) while ckpt-2 is still being written in the
    background: the launch lets the save commit before it stops the trainers, says so in
    one line, and --resume continues from it."""
    bundle = two_ranks
    run_dir = tmp_path / "run"
    out = tmp_path / "out"
    proc = launch_in_background(bundle, run_dir, out, "--steps", "6")
    try:
        wait_for_output(proc, out, "step 2/6", 120)
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM, out.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = out.read_text()
    done = [s for s, _ in complete_checkpoints(run_dir)]
    assert done and done[0] == 2, text[-3000:]
    # a save begun after the signal (the trainers train on while one commits) may be cut
    # short: a .tmp a resume removes, never one of the saves in flight at the signal
    for left in checkpoint_root(run_dir).glob("*.tmp"):
        assert int(left.name[len("ckpt-"):-len(".tmp")]) > done[0], text[-3000:]
    assert f"launch.sh: stopped by SIGTERM; --resume continues from ckpt-{done[-1]}" in text
    assert "SignalException" not in text, text[-3000:]   # torchrun stops without a traceback
    resumed = launch_ok(bundle, run_dir, "--steps", "6", "--resume")
    assert f"resumed from {checkpoint_root(run_dir)}/ckpt-{done[-1]}" in resumed.stdout
    assert [s for s, _ in complete_checkpoints(run_dir)][-1] == 6
