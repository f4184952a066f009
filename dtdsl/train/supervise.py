"""One node of a launch, from the run directory's lock to the last process's exit:
``launch.sh`` parses its arguments, then ``exec``s

    python -m dtdsl.train.supervise BUNDLE --run-dir DIR [--steps N] [--data D] [--resume]
        -- python -m dtdsl.train.torchrun ... BUNDLE/train.py ...

which, on every node alike,

1. takes the run directory's lock (``train.rundir``; the nodes of one launch,
   ``DTDSL_LAUNCH_ID``, share it): another launch on the same directory is refused at
   once, before anything there is read or written;
2. refuses a fresh start (no ``--resume``) into a directory holding an earlier run's
   checkpoints or records (``metrics.jsonl``, ``samples.jsonl``, ``timelines.jsonl``,
   ``tb/``): ``--resume`` continues that run, or another ``--run-dir`` starts a new one.
   Nothing of an earlier run is ever emptied;
3. runs the preflight checks (``train.preflight``), makes the node's feed directory and
   starts the node's preprocessing workers (``workers/worker.py --all``, logging to
   ``RUN_DIR/logs/workers-<host>-<pid>.log``) and the torchrun command it was given;
4. watches them every ``POLL_S``: torchrun's exit ends the launch with its status; a
   fatal record (``feed.faults``: a rank or worker met an error no restart changes, or
   a node's workers gave up) stops torchrun and its ranks at once, and the launch exits
   with ``EXIT_FATAL`` (3) after one line, ``launch.sh: stopped: <who>: <cause>`` (the
   other nodes': ``launch.sh: stopped: on another node: <who>: <cause>``); so
   does the end of the node's worker supervisor with a failure (killed, or given up):
   the trainers would otherwise wait for data in vain. The line is the record's, written
   to the run directory for the other nodes' supervisors, which stop theirs as soon as
   they see it (on NFS, when its attribute cache lets them: seconds);
5. on SIGTERM, SIGINT or SIGHUP (Slurm's time limit, ^C) passes SIGTERM on to torchrun
   and the workers, waits up to ``GRACE_S`` for torchrun, and exits with 128 + the
   signal's number.

torchrun and the workers run in sessions of their own: a signal for this process reaches
them through it, once.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dtdsl.feed.faults import (
    EXIT_FATAL,
    FATAL_ENV,
    FATAL_LOCAL_ENV,
    die_with_parent,
    read_fatal,
    write_fatal,
)
from dtdsl.train.rundir import HEARTBEAT_S, RECORDS, RunDirBusy, RunDirLock, check_launch_id

__all__ = ["GRACE_S", "POLL_S", "earlier_run", "fatal_file", "main", "trainer_env"]

POLL_S = 0.25           # how often the launch looks at its processes and records
GRACE_S = 30.0          # how long torchrun gets to stop its ranks after a signal
WORKERS_GRACE_S = 5.0
_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def fatal_file(run_dir: str | Path, launch_id: str) -> Path:
    """Where the launch ``launch_id`` keeps its fatal record (``feed.faults``)."""
    return Path(run_dir) / "logs" / f"fatal-{launch_id}.txt"


def trainer_env(env: dict[str, str]) -> dict[str, str]:
    """The trainers' environment: ``env`` with the CUDA caching allocator's expandable
    segments on (a step's microbatches change length, and fixed-size blocks of every
    size fragment the GPU's memory; torchtitan and Megatron-LM set it too), unless the
    user configured the allocator themselves."""
    out = dict(env)
    if "PYTORCH_CUDA_ALLOC_CONF" not in out and "PYTORCH_ALLOC_CONF" not in out:
        out["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return out


def _say(text: str) -> None:
    print(f"launch.sh: {text}", file=sys.stderr, flush=True)


def unusable_run_dir(run_dir: Path) -> str | None:
    """Why no launch may write ``run_dir``: it is the filesystem's root, or a folder of
    records dtdsl writes and prunes there (``logs/``, ``tb/``: a resumed run cuts its
    TensorBoard events back to the checkpoint's step) is a symbolic link, which would take
    those writes into whatever folder it names."""
    if os.path.realpath(run_dir) == os.path.realpath(os.sep):
        return f"--run-dir {run_dir} is the filesystem's root: give a folder of its own"
    if run_dir.is_symlink() and not run_dir.exists():
        return (f"--run-dir {run_dir} is a symbolic link to {os.readlink(run_dir)}, which "
                "does not exist: make that folder, or give another")
    for name in ("logs", "tb"):
        if (run_dir / name).is_symlink():
            return (f"{run_dir / name} is a symbolic link; dtdsl writes and prunes its "
                    "records there, not through a link: make it a folder, or choose "
                    "another --run-dir")
    return None


def earlier_run(run_dir: Path) -> str | None:
    """Why a fresh start may not use ``run_dir`` (an earlier run's checkpoints or records
    are there), or None."""
    root = run_dir / "checkpoints"
    if root.is_dir() and any(p.name.startswith("ckpt-") and p.name[5:].isdigit()
                             for p in root.iterdir()):
        return (f"{run_dir} holds checkpoints of an earlier run: --resume continues it; "
                "or choose another --run-dir")
    found = [name for name in RECORDS
             if (run_dir / name).is_file() and (run_dir / name).stat().st_size > 0]
    tb = run_dir / "tb"
    if tb.is_dir() and any(tb.iterdir()):
        found.append("tb/")
    if found:
        return (f"{run_dir} holds the records of an earlier run ({', '.join(found)}; no "
                "checkpoint): --resume starts it again at step 0 and sets them aside "
                "(replaced-<time>/); or choose another --run-dir")
    return None


def _parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    argv = list(argv)
    if "--" not in argv:
        raise SystemExit("supervise: give the torchrun command after --")
    cut = argv.index("--")
    p = argparse.ArgumentParser(prog="python -m dtdsl.train.supervise",
                                description="one node of a launch (launch.sh runs it)")
    p.add_argument("bundle")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--data")
    p.add_argument("--resume", action="store_true")
    args = p.parse_args(argv[:cut])
    command = argv[cut + 1:]
    if not command:
        raise SystemExit("supervise: give the torchrun command after --")
    return args, command


def _children(pid: int) -> list[int] | None:
    """The processes whose parent is ``pid`` (Linux /proc); None where it cannot tell."""
    if not os.path.isdir("/proc"):
        return None
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
            if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
                out.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _kill_tree(proc: subprocess.Popen) -> None:
    """Stop torchrun and its ranks at once, silently: torchrun frozen first (so it
    neither restarts a rank nor logs the others' deaths), each rank's session killed
    (torchrun starts every rank as a session leader), then torchrun."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(OSError):
        os.kill(proc.pid, signal.SIGSTOP)
    kids = _children(proc.pid)
    if kids is None:        # no /proc: torchrun stops its ranks itself
        with contextlib.suppress(OSError):
            os.kill(proc.pid, signal.SIGCONT)
        _stop(proc, signal.SIGTERM, GRACE_S)
        return
    for kid in kids:
        try:
            os.killpg(kid, signal.SIGKILL)
        except OSError:
            with contextlib.suppress(OSError):
                os.kill(kid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def _stop(proc: subprocess.Popen | None, sig: int, grace_s: float) -> None:
    """``sig`` to ``proc``, SIGKILL after ``grace_s`` seconds, and reap it."""
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(OSError):
        proc.send_signal(sig)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            proc.kill()
        proc.wait()


def _status_text(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


class _Node:
    """This node's processes of the launch and what watches them."""

    def __init__(self, args: argparse.Namespace, command: list[str], lock: RunDirLock,
                 launch_id: str) -> None:
        self.args, self.command, self.lock = args, command, lock
        self.bundle, self.run_dir = Path(args.bundle), Path(args.run_dir)
        self.shared = fatal_file(self.run_dir, launch_id)
        self.local: Path | None = None
        self.feed: Path | None = None
        self.workers: subprocess.Popen | None = None
        self.torchrun: subprocess.Popen | None = None
        self.signalled: int | None = None
        self.signals = 0
        self.host = socket.gethostname()

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signalled = signum
        self.signals += 1

    def run(self) -> int:
        from dtdsl.feed.node import feed_dir
        from dtdsl.ir.job import load_job

        for sig in _SIGNALS:
            signal.signal(sig, self._on_signal)
        try:
            job = load_job(self.bundle)
        except ValueError as err:
            _say(str(err))
            return 2
        if not self.args.resume:
            problem = earlier_run(self.run_dir)
            if problem is not None:
                _say(problem)
                return 2
        if self.lock.first:         # a record of this launch id's earlier start (requeue)
            with contextlib.suppress(OSError):
                self.shared.unlink()
        preflight = [sys.executable, "-m", "dtdsl.train.preflight", str(self.bundle),
                     f"--run-dir={self.run_dir}"]
        if self.args.data is not None:
            preflight.append(f"--data={self.args.data}")     # a value, whatever it starts with
        failed = subprocess.run(preflight, stdin=subprocess.DEVNULL, check=False).returncode
        if self.signalled is not None:      # the preflight too was stopped by it
            return self._stopped()
        if failed:
            return 2
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        # The node's workers and trainers meet here (zmq ipc sockets): node-local.
        self.feed = Path(tempfile.mkdtemp(prefix="dtdsl-feed."))
        try:
            feed_dir(self.feed)     # its socket paths fit, or no process could bind them
        except ValueError as err:
            _say(str(err))
            return 2
        self.local = self.feed / "fatal"
        env = {**os.environ, "DTDSL_FEED_DIR": str(self.feed), FATAL_ENV: str(self.shared),
               FATAL_LOCAL_ENV: str(self.local)}
        fd = self.lock.inheritable_fd()
        if job.feed.workers_per_node > 0:
            self.workers = self._start_workers(env, fd)
        # Each in a session of its own (the group kill of ``_kill_tree``), and sent SIGTERM
        # should this supervisor die, even by SIGKILL: no headless job trains on.
        self.torchrun = subprocess.Popen(self.command, env=trainer_env(env),
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         pass_fds=(fd,),
                                         preexec_fn=die_with_parent(os.getpid()))  # noqa: PLW1509
        return self._watch()

    def _start_workers(self, env: dict[str, str], fd: int) -> subprocess.Popen:
        argv = [sys.executable, str(self.bundle / "workers" / "worker.py"), "--all",
                f"--run-dir={self.run_dir}", "--steps", str(self.args.steps)]
        if self.args.data is not None:
            argv.append(f"--data={self.args.data}")
        if self.args.resume:
            argv.append("--resume")
        log = self.run_dir / "logs" / f"workers-{self.host}-{os.getpid()}.log"
        with open(log, "ab") as out:
            return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    pass_fds=(fd,),
                                    preexec_fn=die_with_parent(os.getpid()))  # noqa: PLW1509

    def _record(self) -> str | None:
        """What to say of the launch's fatal record, if there is one: its line, after
        "on another node: " when this node's processes did not write it."""
        mine = read_fatal(self.local)
        if mine is not None:
            return mine
        line = read_fatal(self.shared)
        return None if line is None else f"on another node: {line}"

    def _watch(self) -> int:
        assert self.torchrun is not None
        while True:
            if self.signalled is not None:
                # A save in flight commits first (the trainers still train meanwhile, and
                # die at once on their SIGTERM: blocked in a collective, a rank could not
                # run a Python handler); then the trainers, then their data.
                self._let_saves_commit(GRACE_S)
                _stop(self.torchrun, signal.SIGTERM, GRACE_S)
                _kill_tree(self.torchrun)
                _stop(self.workers, signal.SIGTERM, WORKERS_GRACE_S)
                return self._stopped()
            line = self._record()
            if line is not None:
                return self._fatal(line)
            code = self.torchrun.poll()
            if code is not None:
                line = self._record()
                if line is not None:
                    return self._fatal(line)
                _stop(self.workers, signal.SIGTERM, WORKERS_GRACE_S)
                return code
            if self.workers is not None and self.workers.poll() is not None:
                if self.workers.returncode == 0:
                    self.workers = None     # done: the trainers said so
                else:
                    return self._workers_failed(self.workers.returncode)
            time.sleep(POLL_S)

    def _let_saves_commit(self, limit_s: float) -> None:
        """Wait up to ``limit_s`` for the checkpoints being written when the signal came
        (``ckpt-N.tmp``) to be committed or given up, while torchrun runs; a second signal
        stops the wait."""
        from dtdsl.ir.checkpoint import checkpoint_root

        first = self.signals
        try:
            writing = list(checkpoint_root(self.run_dir).glob("ckpt-*.tmp"))
        except OSError:
            return
        if writing:
            _say(f"{self.signalled_name()}: waiting for {writing[-1].name} to be committed "
                 f"(at most {limit_s:g} s; signal again to stop now)")
        deadline = time.monotonic() + limit_s
        while (any(p.exists() for p in writing) and time.monotonic() < deadline
               and self.signals == first and self.torchrun is not None
               and self.torchrun.poll() is None):
            time.sleep(POLL_S)

    def signalled_name(self) -> str:
        assert self.signalled is not None
        return signal.Signals(self.signalled).name

    def _stopped(self) -> int:
        """One line for a launch stopped by a signal, and its exit status (128 + it)."""
        from dtdsl.ir.checkpoint import latest_checkpoint

        assert self.signalled is not None
        newest = latest_checkpoint(self.run_dir)
        then = (f"--resume continues from {newest.name}" if newest is not None else
                "no checkpoint yet: --resume starts it again at step 0")
        _say(f"stopped by {self.signalled_name()}; {then}")
        return 128 + self.signalled

    def _workers_failed(self, code: int) -> int:
        """The node's worker supervisor ended with a failure: it has written the record
        when it gave up on a worker; killed, it could not, and this node says so."""
        line = self._record()
        if line is None:
            log = self.run_dir / "logs" / f"workers-{self.host}-{os.getpid()}.log"
            cause = (f"node {self.host}: the preprocessing workers' supervisor "
                     f"{_status_text(code)}; the trainers would wait for data in vain "
                     f"(see {log})")
            write_fatal(cause, self.shared, self.local)
            line = self._record() or cause
        return self._fatal(line)

    def _fatal(self, line: str) -> int:
        if self.torchrun is not None:
            _kill_tree(self.torchrun)
        _stop(self.workers, signal.SIGTERM, WORKERS_GRACE_S)
        _say(f"stopped: {line}")
        return EXIT_FATAL

    def close(self) -> None:
        _stop(self.workers, signal.SIGKILL, WORKERS_GRACE_S)
        if self.torchrun is not None:
            _kill_tree(self.torchrun)
        if self.feed is not None:
            shutil.rmtree(self.feed, ignore_errors=True)


def _heartbeat(lock: RunDirLock, stop: threading.Event) -> None:
    while not stop.wait(HEARTBEAT_S):
        lock.heartbeat()


def main(argv: Sequence[str] | None = None) -> int:
    args, command = _parse(sys.argv[1:] if argv is None else argv)
    launch_id = os.environ.get("DTDSL_LAUNCH_ID", "")
    try:
        check_launch_id(launch_id)
    except ValueError as err:
        _say(str(err))
        return 2
    problem = unusable_run_dir(Path(args.run_dir))
    if problem is not None:
        _say(problem)
        return 2
    lock = RunDirLock(args.run_dir, launch_id)
    try:
        lock.acquire()
    except RunDirBusy as err:
        _say(str(err))
        return 2
    except OSError as err:
        _say(f"cannot use --run-dir {args.run_dir}: {err.strerror or err}")
        return 2
    stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(lock, stop), daemon=True)
    beat.start()
    node = _Node(args, command, lock, launch_id)
    try:
        return node.run()
    finally:
        node.close()
        stop.set()
        lock.release()


if __name__ == "__main__":
    sys.exit(main())
