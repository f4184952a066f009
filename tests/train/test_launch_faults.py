"""Faults no restart changes end a launch at once with one line (``feed.faults``,
``train.supervise``): what counts as one, the fatal record, the preflight's checks, and
launched bundles meeting a full disk, a changed spec on --resume, a job key others may
read, and a dead worker pool."""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dtdsl import cli
from dtdsl.feed.faults import (
    EXIT_FATAL,
    FATAL_ENV,
    FATAL_LOCAL_ENV,
    Fatal,
    fatal_cause,
    hold_if_fatal,
    read_fatal,
    write_fatal,
)
from dtdsl.ir.checkpoint import CheckpointError, Manifest, UnitLayout, checkpoint_root
from dtdsl.ir.job import load_job
from tests.helpers.bundle import (
    SPEC,
    launch,
    launch_in_background,
    wait_for_output,
)

# ---- what no restart changes ----------------------------------------------------------------


def _raised(make) -> BaseException:
    try:
        make()
    except BaseException as err:        # noqa: BLE001
        return err
    raise AssertionError("nothing raised")


def test_what_a_restart_cannot_change():
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/run/ckpt-4.tmp/__1_0.distcp")

    def save_failed():
        try:
            raise full
        except OSError as err:
            raise CheckpointError("a background checkpoint save failed") from err

    cause = fatal_cause(_raised(save_failed))
    assert cause == ("the disk is full: OSError: [Errno 28] No space left on device: "
                     "'/run/ckpt-4.tmp/__1_0.distcp'; free space there, or choose another "
                     "--run-dir")
    quota = OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
    assert fatal_cause(quota).startswith("the disk quota is used up")
    # only the text crossed from another rank (the checkpoint's exchange)
    relayed = CheckpointError("ckpt-4 was not committed: rank 0: CheckpointError: rank 2 "
                              "could not write its part: OSError: [Errno 28] No space left "
                              "on device")
    assert fatal_cause(relayed).startswith("the disk is full: CheckpointError: ckpt-4")
    torch_short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos "
                               "704 vs 598")
    assert fatal_cause(torch_short).startswith("a write stopped short (the disk is most "
                                               "likely full or over quota)")
    key = PermissionError("job.key has mode 0644: the job secret must be private to its "
                          "owner; run: chmod 600 job.key")
    assert fatal_cause(key) == str(key)
    assert fatal_cause(Fatal("recompile\nthe bundle")) == "recompile the bundle"
    from dtdsl.models.hf.config import HFError

    assert fatal_cause(HFError("model.safetensors: tensor x has shape (2,)")) == \
        "model.safetensors: tensor x has shape (2,)"
    from dtdsl.ir.checkpoint import CheckpointMismatch
    from dtdsl.models.hf.weights import WeightsFileError
    from dtdsl.models.vae import VAEError

    for err in (WeightsFileError("model.safetensors: cut short"), VAEError("vae: bad config"),
                CheckpointMismatch("ckpt-2 was written for spec s")):
        assert fatal_cause(err) == str(err)
    # what a restart may well change
    for err in (RuntimeError("Connection closed by peer [127.0.0.1]:1234"),
                ConnectionResetError(errno.ECONNRESET, "reset"), TimeoutError("timed out"),
                CheckpointError("ckpt-4 was not committed: rank 0: DistStoreError: wait "
                                "timeout"), KeyError("x")):
        assert fatal_cause(err) is None, err


def test_the_first_record_wins_and_a_full_run_directory_falls_back_to_the_node(tmp_path):
    shared, local = tmp_path / "run" / "logs" / "fatal-L.txt", tmp_path / "feed" / "fatal"
    local.parent.mkdir()
    assert write_fatal("rank 1: the disk is full", shared, local) == shared
    assert write_fatal("rank 0: later\nand longer", shared, local) == shared
    assert read_fatal(shared) == "rank 1: the disk is full"
    assert read_fatal(local) == "rank 1: the disk is full"
    assert not [p for p in shared.parent.iterdir() if p.name.endswith(".tmp")]
    # the run directory cannot take it (its logs/ is a file here): the node's copy does
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "logs").write_text("not a directory")
    local2 = tmp_path / "feed" / "fatal2"
    assert write_fatal("worker 0: x", blocked / "logs" / "fatal-L.txt", local2) == local2
    assert read_fatal(blocked / "logs" / "fatal-L.txt", local2) == "worker 0: x"
    assert read_fatal(None, tmp_path / "missing") is None


def test_a_failing_process_records_and_holds_only_for_what_no_restart_changes(
        tmp_path, monkeypatch):
    from dtdsl.feed import faults

    class Clock:                        # the module's clock: its naps counted, not slept
        monotonic = staticmethod(time.monotonic)
        naps: list[float] = []

        def sleep(self, seconds: float) -> None:
            self.naps.append(seconds)

    clock = Clock()
    monkeypatch.setattr(faults, "time", clock)
    held: list[str] = []

    def hold(who: str, err: BaseException) -> None:
        clock.naps = []
        hold_if_fatal(err, who, hold_s=0.05)
        if clock.naps:
            held.append(who)

    shared, local = tmp_path / "fatal.txt", tmp_path / "local"
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "x")
    lost = RuntimeError("Connection closed by peer")
    # outside a launch: nothing recorded, no wait
    monkeypatch.delenv(FATAL_ENV, raising=False)
    hold("rank 1", full)
    assert held == [] and not shared.exists()
    monkeypatch.setenv(FATAL_ENV, str(shared))
    monkeypatch.setenv(FATAL_LOCAL_ENV, str(local))
    hold("rank 2", lost)                # a restart may help: no record, no wait
    assert held == [] and not shared.exists()
    hold("rank 1", full)
    assert held == ["rank 1"]
    assert read_fatal(shared).startswith("rank 1: the disk is full: OSError")
    hold("rank 1", full)                # held once already: not again
    assert held == ["rank 1"]
    # once recorded, any failure is its consequence: it holds, and records nothing
    hold("rank 3", RuntimeError("Connection closed by peer"))
    assert held == ["rank 1", "rank 3"]
    assert read_fatal(shared).startswith("rank 1: ")


# ---- the preflight's checks, and the rank's own ---------------------------------------------

@pytest.fixture(scope="module")
def bundle(tiny_run) -> Path:
    """tiny_cpu with a checkpoint every 2 steps and 2 workers on its dataset: the shared
    run's bundle (``tests/conftest.py``'s ``tiny_run``). Shared: a test that changes it
    (its key's mode) changes a copy."""
    return tiny_run.bundle


@pytest.fixture(scope="module")
def dataset(tiny_run) -> Path:
    """The tiny spec's dataset: the shared run's (one made fewer)."""
    return tiny_run.dataset


def _fake_checkpoint(run_dir: Path, step: int, spec_sha256: str,
                     program_sha256: str | None = None) -> Path:
    path = checkpoint_root(run_dir) / f"ckpt-{step}"
    with warnings.catch_warnings():     # DCP's note that it saves in one process
        warnings.filterwarnings("ignore", message=".*single process")
        dcp.save({"x": torch.zeros(4)}, checkpoint_id=str(path), no_dist=True)
    manifest = Manifest(step=step, next_step=step, spec="other", spec_sha256=spec_sha256,
                        plan_sha256="b" * 64, world_size=1,
                        units=(UnitLayout(name="u", tp=1, dp=1, pp=1),), mode="sync",
                        num_tensors=0, rng_torch="", program_sha256=program_sha256)
    (path / "manifest.json").write_text(manifest.model_dump_json())
    return path


def test_a_first_runs_preflight_passes_without_importing_torch(tmp_path, tiny_run):
    # launch.sh runs it on every node before torchrun: a first run's checks (data, key,
    # no checkpoint) read files only, so it starts in a fraction of torch's import time.
    code = ("import sys\n"
            "from dtdsl.train.preflight import main\n"
            f"rc = main([{str(tiny_run.bundle)!r}, '--run-dir', {str(tmp_path / 'run')!r}])\n"
            "print(rc, 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["0", "False"], out.stdout + out.stderr


def test_preflight_refuses_a_loose_key_and_a_checkpoint_of_another_spec(tmp_path, tiny_run):
    from dtdsl.train.launch import _check_resumable
    from dtdsl.train.preflight import check_key, check_resume

    bundle = tiny_run.bundle_copy(tmp_path)        # its key's mode changed: a copy
    job = load_job(bundle)
    key = bundle / job.secret_file
    assert check_key(bundle, job) == []
    key.chmod(0o644)
    try:
        assert check_key(bundle, job) == [
            f"{key} has mode 0644: the job secret must be private to its owner; run: "
            f"chmod 600 {key}"]
    finally:
        key.chmod(0o600)
    run_dir = tmp_path / "run"
    assert check_resume(job, run_dir) == []
    _fake_checkpoint(run_dir, 2, job.spec_sha256)
    assert check_resume(job, run_dir) == []
    _check_resumable(run_dir, job.spec_sha256)
    newest = _fake_checkpoint(run_dir, 4, "c" * 64)
    said = check_resume(job, run_dir)
    assert said == [f"{newest} was written for spec other (sha256 cccccccccccc...) but this "
                    f"bundle is of spec tiny_cpu (sha256 {job.spec_sha256[:12]}...): resume "
                    "it with the bundle it was trained with, or choose another --run-dir"]
    with pytest.raises(Fatal, match="was written for spec other"):
        _check_resumable(run_dir, job.spec_sha256)
    # Its files cut short, or a newer ckpt-N damaged: one line before torchrun, not a
    # restart loop on files that stay as they are (or a silent step back over them).
    shutil.rmtree(newest)
    # the same program in another text (a comment, dtc fmt): resumable
    assert job.program_sha256 is not None
    newest = _fake_checkpoint(run_dir, 4, "c" * 64, job.program_sha256)
    assert check_resume(job, run_dir) == []
    _check_resumable(run_dir, job.spec_sha256, job.program_sha256)
    shutil.rmtree(newest)
    newest = _fake_checkpoint(run_dir, 4, job.spec_sha256)
    (shard,) = newest.glob("*.distcp")
    os.truncate(shard, 3)
    assert check_resume(job, run_dir) == [
        f"cannot load {newest}: {shard} holds 3 bytes, its entries reach byte "
        f"{_end(newest):,}: it was cut short; move it out of {checkpoint_root(run_dir)} to "
        "resume from ckpt-2"]
    shutil.rmtree(newest)
    damaged = _fake_checkpoint(run_dir, 6, job.spec_sha256)
    (damaged / "manifest.json").write_text("{")
    (said,) = check_resume(job, run_dir)
    assert said.startswith(f"{damaged} is not a complete checkpoint (") and said.endswith(
        f"; move it out of {checkpoint_root(run_dir)} to resume from ckpt-2")


def _end(ckpt: Path) -> int:
    """Where the storage table's entries end (read by DCP's reader: our own test's file)."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(ckpt)).read_metadata()
    return max(i.offset + i.length for i in meta.storage_data.values())


def test_a_fatal_stop_kills_torchrun_and_its_ranks_at_once(tmp_path):
    """torchrun starts each rank as a session leader: stopping the launch stops them too,
    not only torchrun (whose death would leave them running)."""
    from dtdsl.train.supervise import _children, _kill_tree

    pids = tmp_path / "pids"
    fake = tmp_path / "torchrun.py"
    fake.write_text(
        "import subprocess, sys, time\n"
        "kids = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'],"
        " start_new_session=True) for _ in range(2)]\n"
        f"open({str(pids)!r}, 'w').write(' '.join(str(k.pid) for k in kids))\n"
        "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, str(fake)])
    deadline = time.monotonic() + 60
    while not (pids.exists() and pids.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    kids = [int(p) for p in pids.read_text().split()]
    assert sorted(_children(proc.pid)) == sorted(kids)
    _kill_tree(proc)
    assert proc.returncode == -signal.SIGKILL
    for kid in kids:
        deadline = time.monotonic() + 10
        while _running(kid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(kid), kid


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# ---- launched bundles ----------------------------------------------------------------------

def _attempts(out: str) -> int:
    """How many times torchrun started the job (rank 0 says so once per attempt)."""
    return len(re.findall(r"^rank 0 of \d+ on ", out, re.M))


@pytest.mark.slow
def test_a_full_disk_stops_the_launch_with_one_line_and_no_restart(tmp_path, bundle):
    run_dir = tmp_path / "run"
    proc = launch(bundle, run_dir, "--steps", "4", env={"DTDSL_FAULT": "rank1@2:enospc"},
                  timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_FATAL, out[-6000:]
    said = [line for line in out.splitlines() if "No space left" in line]
    assert said == [f"launch.sh: stopped: rank 1: the disk is full: OSError: [Errno 28] No "
                    f"space left on device: '{run_dir}/checkpoints/ckpt-2.tmp'; free space "
                    "there, or choose another --run-dir"], out[-6000:]
    assert _attempts(out) == 1 and "Traceback" not in out and "restart" not in out, out
    launch_id = next((run_dir / "launches").iterdir()).name
    assert (run_dir / "logs" / f"fatal-{launch_id}.txt").read_text().startswith(
        "rank 1: the disk is full")


@pytest.mark.slow
def test_a_stage_no_rank_can_build_stops_the_launch_with_one_line(tmp_path, tiny_run):
    # A program the checker would refuse, written into the bundle by hand: the generator
    # rank cannot build its U-Net (0 heads of 128 at its attention level) on any attempt,
    # so the launch stops at once with the reason instead of torchrun's restarts.
    import json

    edited = tiny_run.bundle_copy(tmp_path)
    program = json.loads((edited / "program.json").read_text())
    gen = next(m for m in program["modules"] if m["name"] == "gen")
    gen["arch"]["head_dim"] = 128
    (edited / "program.json").write_text(json.dumps(program))
    proc = launch(edited, tmp_path / "run", "--steps", "2", timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_FATAL, out[-6000:]
    said = [line for line in out.splitlines() if line.startswith("launch.sh: stopped:")]
    assert len(said) == 1 and "cannot build this rank's stage: " in said[0] and \
        "0 attention heads" in said[0], out[-6000:]
    assert _attempts(out) == 1 and "restart" not in out, out[-6000:]


@pytest.mark.slow
def test_a_changed_spec_on_resume_and_a_loose_key_stop_before_torchrun(
        tmp_path, dataset, tiny_run):  # noqa: F811
    # A run with checkpoints: a copy of the shared one's (ckpt-4, ckpt-6, ckpt-8).
    assert tiny_run.returncode == 0, tiny_run.out.read_text()[-3000:]
    run_dir = tmp_path / "run"
    shutil.copytree(tiny_run.run_dir, run_dir)
    other = tmp_path / "other"
    spec = tmp_path / "other.dt"
    assert "seed             = 1234" in SPEC.read_text()
    spec.write_text(SPEC.read_text().replace("seed             = 1234", "seed             = 4321"))
    assert cli.main(["compile", str(spec), "-o", str(other), "--data", str(dataset),
                     "--workers", "2"]) == 0
    proc = launch(other, run_dir, "--steps", "10", "--resume", timeout=120)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout == "" and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert f"{run_dir}/checkpoints/ckpt-8 was written for spec tiny_cpu (sha256 " in \
        proc.stderr and "resume it with the bundle it was trained with" in proc.stderr
    # a job key that others may read (of a copy of the shared bundle)
    bundle = tiny_run.bundle_copy(tmp_path / "copy")
    key = bundle / load_job(bundle).secret_file
    key.chmod(0o640)
    try:
        proc = launch(bundle, tmp_path / "run2", "--steps", "2", timeout=120)
    finally:
        key.chmod(0o600)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout[-3000:] + proc.stderr
    assert proc.stderr.splitlines() == [
        f"launch.sh: {key} has mode 0640: the job secret must be private to its owner; run: "
        f"chmod 600 {key}"]


def _worker_supervisor(launcher: int, bundle: Path) -> int | None:
    from dtdsl.train.supervise import _children

    for pid in _children(launcher) or []:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if str(bundle / "workers" / "worker.py").encode() in argv and b"--all" in argv:
            return pid
    return None


@pytest.mark.slow
def test_a_dead_worker_pool_ends_the_launch_with_one_line(tmp_path, bundle):
    run_dir = tmp_path / "run"
    out = tmp_path / "out"
    proc = launch_in_background(bundle, run_dir, out, "--steps", "200")
    try:
        wait_for_output(proc, out, "step 2/200", 180)
        workers = _worker_supervisor(proc.pid, bundle)
        assert workers is not None
        os.kill(workers, signal.SIGKILL)
        # well before the trainers' 600 s wait for data would end
        assert proc.wait(timeout=120) == EXIT_FATAL, out.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = out.read_text()
    said = [line for line in text.splitlines() if line.startswith("launch.sh:")]
    assert said == [
        f"launch.sh: stopped: node {socket.gethostname()}: the preprocessing workers' "
        "supervisor was killed by SIGKILL; the trainers would wait for data in vain (see "
        f"{run_dir}/logs/workers-{socket.gethostname()}-{proc.pid}.log)"], text[-3000:]
    assert _attempts(text) == 1 and "Traceback" not in text, text[-3000:]
    assert "step 200/200" not in text


@pytest.mark.slow
def test_a_fault_on_one_node_stops_every_node_with_one_line(tmp_path, dataset):  # noqa: F811
    """Three nodes (launch.sh three times on this machine, one launch id, one run
    directory): rank 4, on the last node, meets a full disk; every node stops with one
    line, the others saying it was met on another node."""
    from dtdsl.feed import wire
    from tests.helpers.bundle import three_node_spec

    bundle = tmp_path / "bundle"
    assert cli.main(["compile", str(three_node_spec(tmp_path)), "-o", str(bundle), "--data",
                     str(dataset), "--workers", "2"]) == 0
    rdzv = f"127.0.0.1:{wire.free_port_base(1)}"
    env = {**os.environ, "PYTHON": sys.executable, "DTDSL_LAUNCH_ID": "three-1",
           "DTDSL_FAULT": "rank4@2:enospc"}
    outs = [tmp_path / f"node{k}.out" for k in range(3)]
    procs = []
    try:
        for out in outs:
            with open(out, "w") as sink:
                procs.append(subprocess.Popen(
                    ["bash", str(bundle / "launch.sh"), "--nnodes", "3", "--rdzv", rdzv,
                     "--run-dir", str(tmp_path / "run"), "--steps", "4"], stdout=sink,
                    stderr=subprocess.STDOUT, env=env, start_new_session=True))
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    texts = [out.read_text() for out in outs]
    assert codes == [EXIT_FATAL] * 3, [t[-2000:] for t in texts]
    cause = (f"rank 4: the disk is full: OSError: [Errno 28] No space left on device: "
             f"'{tmp_path}/run/checkpoints/ckpt-2.tmp'; free space there, or choose another "
             "--run-dir")
    said = sorted(line for t in texts for line in t.splitlines()
                  if line.startswith("launch.sh:"))
    assert said == [f"launch.sh: stopped: on another node: {cause}"] * 2 + \
        [f"launch.sh: stopped: {cause}"], texts
    assert all("Traceback" not in t for t in texts), texts
    assert sum(_attempts(t) for t in texts) == 1


def test_a_feed_directory_too_long_for_sockets_stops_before_torchrun(tmp_path, bundle):
    """The node's feed directory (under TMPDIR) takes Unix socket paths: too long a one
    is one line, before any worker or trainer fails on it."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    proc = launch(bundle, tmp_path / "run", "--steps", "2", env={"TMPDIR": str(deep)},
                  timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout[-3000:] + proc.stderr
    # The first launch on the dataset indexes it first and says so (progress, not errors).
    lines = [line for line in proc.stderr.splitlines()
             if not line.startswith("launch.sh: indexing ")]
    assert len(lines) == 1 and lines[0].startswith(f"launch.sh: the feed directory {deep}/"
                                                   "dtdsl-feed.") and \
        lines[0].endswith("is too long for Unix socket paths (107 bytes): set TMPDIR to a "
                          "shorter directory"), proc.stderr
    assert not list(deep.iterdir())         # removed


def test_trainers_get_expandable_segments_unless_the_allocator_is_configured():
    from dtdsl.train.supervise import trainer_env

    assert trainer_env({"A": "1"}) == {"A": "1",
                                       "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    mine = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}
    assert trainer_env(mine) == mine
    assert trainer_env({"PYTORCH_ALLOC_CONF": "x"}) == {"PYTORCH_ALLOC_CONF": "x"}


def test_preflight_refuses_an_edited_plan_and_world_in_one_line_each(tmp_path, tiny_run):
    import json

    from dtdsl.train.preflight import check_plan, main

    bundle = tiny_run.bundle_copy(tmp_path)
    job = load_job(bundle)
    from dtdsl.ir.program import Program

    program = Program.model_validate_json((bundle / job.program_file).read_bytes())
    assert check_plan(bundle, job, program) == []
    plan_path = bundle / job.plan_file
    plan = json.loads(plan_path.read_text())
    plan["units"][0]["tp"] = -1
    plan_path.write_text(json.dumps(plan))
    said = check_plan(bundle, job, program)
    assert said and all("\n" not in line and line.endswith("compile the bundle again")
                        for line in said), said
    assert "tp, dp, pp, vpp, cp and ep must be at least 1" in said[0]
    assert main([str(bundle)]) == 2
    plan["units"][0]["tp"] = "x"
    plan_path.write_text(json.dumps(plan))
    assert check_plan(bundle, job, program)[0].startswith(
        f"{plan_path} is not a plan: units.0.tp")
    shutil.copy(tiny_run.bundle / job.plan_file, plan_path)
    for world in (job.world_size + 1, 10**9):
        wrong = job.model_copy(update={"world_size": world})
        said = check_plan(bundle, wrong, program)
        assert f"job.json's world_size {world} is not the plan's {job.world_size} GPUs" \
            in said[0], said
