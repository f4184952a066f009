"""The feed when the workers fail: a waiting trainer says so every few seconds (which
step, how long, which workers are silent), and the workers' supervisor gives up on a crash
loop or an error no restart changes, leaving the worker's last error as the launch's
fatal record."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dtdsl import cli
from dtdsl.feed import wire
from dtdsl.feed.client import REPORT_ENV, FeedTimeout, RemoteBatches
from dtdsl.feed.faults import FATAL_ENV, FATAL_LOCAL_ENV
from dtdsl.feed.protocol import BATCH
from dtdsl.feed.worker import CRASH_LOOP, CRASH_WINDOW_S, FeedContext, build_messages
from dtdsl.ir.job import load_job
from dtdsl.parallel.mesh import role_of

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "specs" / "tiny_cpu.dt"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    """The tiny spec with two workers a node, fed by a small dataset."""
    root = tmp_path_factory.mktemp("feedfaults")
    data = root / "data"
    assert cli.main(["data", "synth", str(SPEC), "-o", str(data), "--samples", "32",
                     "-q"]) == 0
    out = root / "bundle"
    assert cli.main(["compile", str(SPEC), "-o", str(out), "--data", str(data),
                     "--workers", "2"]) == 0
    return out


def test_a_waiting_trainer_reports_which_step_how_long_and_which_workers_are_silent(
        bundle, tmp_path, monkeypatch, capsys):
    job = load_job(bundle)
    assert job.feed.workers_per_node == 2
    ctx = FeedContext(bundle)
    secret = wire.read_secret(bundle / job.secret_file)
    monkeypatch.setenv(REPORT_ENV, "0.3")
    feeds = [RemoteBatches(job, bundle, ctx.program, ctx.plan, role_of(ctx.plan, r),
                           feed_dir=tmp_path, local_rank=r, node_ranks=[0, 1],
                           timeout_s=30.0) for r in (0, 1)]
    sender = wire.Sender(job.feed.trainer_address(tmp_path, 0), secret)
    try:
        sender.send(BATCH, *build_messages(ctx, 0, [0])[0], timeout_s=10)   # worker 0's
        assert feeds[0].batch(0).step == 0
        for feed in feeds:
            feed.timeout_s = 2.5
        with pytest.raises(FeedTimeout, match="no data for step 1 in 2.5 s"):
            feeds[0].batch(1)           # worker 1's step: it never sends
        out = capsys.readouterr().out
        lines = [line for line in out.splitlines() if line.startswith("rank 0: waiting")]
        assert len(lines) >= 2, out
        first = lines[0]
        assert re.match(r"rank 0: waiting \d+ s for the data of step 1 \(worker 1 of the "
                        r"node's 2 makes it\); silent: .*worker 1 \(nothing yet in \d+ s\)"
                        r"; giving up after 2.5 s$", first), first
        assert any(re.search(r"worker 0 \(last step 0, \d+ s ago\)", line) for line in lines)
        # the node's other trainers wait without a word (its first one speaks for them)
        with pytest.raises(FeedTimeout):
            feeds[1].batch(0)
        assert "waiting" not in capsys.readouterr().out
    finally:
        sender.close()
        for feed in feeds:
            feed.close()


def _worker_bundle(bundle: Path, tmp_path: Path, body: str) -> Path:
    """A copy of ``bundle`` whose worker program runs the real worker command line with
    ``body`` run first (to make each worker fail)."""
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    (copy / "workers" / "worker.py").write_text(
        "import sys\nfrom pathlib import Path\nfrom dtdsl.feed import worker\n" + body +
        "\nsys.exit(worker.main(Path(__file__).resolve().parent.parent, sys.argv[1:]))\n")
    return copy


def _supervise(copy: Path, tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess,
                                                                   Path]:
    feed = tmp_path / "feed"
    feed.mkdir()
    fatal = tmp_path / "run" / "logs" / "fatal-L.txt"
    env = {**os.environ, "DTDSL_FEED_DIR": str(feed), FATAL_ENV: str(fatal),
           FATAL_LOCAL_ENV: str(feed / "fatal")}
    proc = subprocess.run([sys.executable, str(copy / "workers" / "worker.py"), "--all",
                           "--run-dir", str(tmp_path / "run"), "--steps", "4", *extra],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    return proc, fatal


@pytest.mark.slow
def test_a_crash_loop_gives_up_with_the_workers_last_error(bundle, tmp_path):
    copy = _worker_bundle(bundle, tmp_path, "def boom(*a, **k):\n"
                          "    raise RuntimeError('decoder exploded')\n"
                          "worker.run_worker = boom\n")
    proc, fatal = _supervise(copy, tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    host = socket.gethostname()
    said = fatal.read_text().strip()
    assert re.fullmatch(rf"workers: preprocessing worker [01] on {re.escape(host)} failed "
                        rf"{CRASH_LOOP} times in {CRASH_WINDOW_S:.0f} s; its last error: "
                        r"RuntimeError: decoder exploded", said), said
    restarts = re.findall(r"restarting it \((\d+)/20\)", proc.stderr)
    assert len(restarts) <= 2 * (CRASH_LOOP - 1), proc.stderr[-3000:]
    assert "giving up" in proc.stderr


@pytest.mark.slow
def test_an_error_no_restart_changes_gives_up_at_once(bundle, tmp_path):
    """The job key made readable by others after the launch began: a worker starting
    then cannot read it, and no restart would."""
    copy = _worker_bundle(bundle, tmp_path, "")
    (copy / load_job(copy).secret_file).chmod(0o644)
    proc, fatal = _supervise(copy, tmp_path, "--data", str(bundle.parent / "data"))
    assert proc.returncode == 1, proc.stderr[-3000:]
    said = fatal.read_text().strip()
    key = copy / "job.key"
    assert re.fullmatch(rf"workers: preprocessing worker [01] on .* cannot go on; its last "
                        rf"error: {re.escape(str(key))} has mode 0644: the job secret must "
                        r"be private to its owner; run: chmod 600 .*", said), said
    assert "restarting it" not in proc.stderr
    assert (tmp_path / "feed" / "fatal").read_text().strip() == said


@pytest.mark.slow
def test_a_feed_directory_no_socket_fits_in_gives_up_at_once(bundle, tmp_path):
    copy = _worker_bundle(bundle, tmp_path, "")
    feed = tmp_path / ("f" * 50) / ("g" * 50)
    feed.mkdir(parents=True)
    fatal = tmp_path / "fatal.txt"
    env = {**os.environ, "DTDSL_FEED_DIR": str(feed), FATAL_ENV: str(fatal)}
    proc = subprocess.run([sys.executable, str(copy / "workers" / "worker.py"), "--all",
                           "--run-dir", str(tmp_path / "run"), "--steps", "4"],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 1, proc.stderr[-3000:]
    said = fatal.read_text().strip()
    assert re.fullmatch(r"workers: preprocessing worker [01] on .* cannot go on; its last "
                        rf"error: the feed directory {re.escape(str(feed))} is too long for "
                        r"Unix socket paths \(107 bytes\): set TMPDIR to a shorter directory",
                        said), said


@pytest.mark.slow
def test_a_data_source_gone_gives_up_at_once(bundle, tmp_path):
    """The data named nothing by the time a worker starts: no restart brings it back."""
    copy = _worker_bundle(bundle, tmp_path, "")
    gone = tmp_path / "gone"
    proc, fatal = _supervise(copy, tmp_path, "--data", str(gone))
    assert proc.returncode == 1, proc.stderr[-3000:]
    said = fatal.read_text().strip()
    assert re.fullmatch(r"workers: preprocessing worker [01] on .* cannot go on; its last "
                        rf"error: .*{re.escape(str(gone))}.*", said), said
    assert "restarting it" not in proc.stderr


@pytest.mark.slow
def test_a_killed_worker_is_still_restarted(bundle, tmp_path):
    """Bad luck, not a loop: a worker killed once is started again, and the workers end
    when the trainers say so (here: none come, and the supervisor is stopped)."""
    copy = _worker_bundle(bundle, tmp_path,
                          "import os, signal\n"
                          "marker = Path(__file__).with_name('killed-once')\n"
                          "if '--index' in sys.argv and not marker.exists():\n"
                          "    marker.write_text('x')\n"
                          "    os.kill(os.getpid(), signal.SIGKILL)\n")
    feed = tmp_path / "feed"
    feed.mkdir()
    env = {**os.environ, "DTDSL_FEED_DIR": str(feed),
           FATAL_ENV: str(tmp_path / "fatal.txt")}
    log = tmp_path / "log"
    with open(log, "w") as sink:
        proc = subprocess.Popen([sys.executable, str(copy / "workers" / "worker.py"),
                                 "--all", "--run-dir", str(tmp_path / "run"), "--steps", "4",
                                 "--data", str(bundle.parent / "data")],
                                env=env, stderr=sink)
    try:
        deadline = time.monotonic() + 120
        while "restarting it" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.1)
        time.sleep(1)
        assert proc.poll() is None, log.read_text()[-3000:]     # still serving
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    err = log.read_text()
    assert "was killed by SIGKILL); restarting it (1/20)" in err, err[-3000:]
    assert "giving up" not in err and not (tmp_path / "fatal.txt").exists()


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG: Linux")
def test_a_supervisor_killed_by_sigkill_takes_its_children_along():
    """torchrun and the workers run in sessions of their own (no group kill reaches them):
    without a parent-death signal they would train on, headless, after ``kill -9``."""
    code = ("import os, subprocess, sys, time\n"
            "from dtdsl.feed.faults import die_with_parent\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],\n"
            "                         start_new_session=True,\n"
            "                         preexec_fn=die_with_parent(os.getpid()))\n"
            "print(child.pid, flush=True)\n"
            "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert _alive(child)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child)
    finally:
        parent.kill()
        parent.wait()
