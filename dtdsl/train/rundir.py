"""The run directory's lock: one launch at a time writes a run directory.

A launch is one ``launch.sh`` on every node of the job, all with the same
``DTDSL_LAUNCH_ID`` (``slurm.sbatch`` gives every node the job's). Each node's launch
supervisor (``train.supervise``) takes the lock before it reads or writes anything in the
run directory and holds it until it exits; the nodes of one launch share it, any other
launch is refused at once, with one line naming the holder.

**What it relies on.** ``RUN_DIR/launch.lock`` is never removed or replaced; every node of
the holding launch keeps a shared ``flock`` on it, and its content names the holding
launch (launch id, host, pid of the first node's supervisor, start time), written only
under the exclusive lock. Taking it:

- an exclusive ``flock`` succeeds: no live process holds it (on this host for certain;
  on every host where the file system's ``flock`` reaches across hosts: NFSv4, Lustre
  mounted ``-o flock``, GPFS). Unless another launch's node on another host has given
  word within ``STALE_S`` (below), this launch takes it: its record is written, and the
  lock turned shared;
- it fails: a shared holder runs. When the record names this launch, the node joins
  (a shared lock of its own); else the launch is refused. (An exclusive holder is another
  node taking it right now: we wait for it, up to ``JOIN_S``.)

File systems whose ``flock`` is local to each host (NFS mounted ``local_lock=flock``,
Lustre ``localflock``, BeeGFS by default) cannot show a holder on another host. For them
every node also keeps ``RUN_DIR/launch.nodes/<host>-<pid>`` (launch id, host, pid),
touched every ``HEARTBEAT_S`` and removed when its supervisor exits: another launch's
node file that changed within ``STALE_S`` (on this host: whose process lives, too)
refuses the lock whatever ``flock`` said; stale ones are removed. So a launch whose nodes
were killed without their exit on another host keeps its run directory for up to
``STALE_S``. Where ``flock`` fails outright (ENOLCK, EOPNOTSUPP), the node files alone
decide; two launches starting within the same instant there can both win, which is the
one case left uncovered.

The lock's file descriptor is handed to the processes the supervisor starts (torchrun, the
preprocessing workers' supervisor): if the supervisor itself is killed, processes still
writing the run directory still hold it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["HEARTBEAT_S", "JOIN_S", "LOCK_FILE", "NODES_DIR", "RECORDS", "STALE_S", "Holder",
           "RunDirBusy", "RunDirLock", "check_launch_id"]

# What rank 0 records of a run, one JSON line per step (with ``tb/``, TensorBoard's): a
# start at step 0 never empties them (``launch.sh`` refuses it, ``train.py`` sets them
# aside).
RECORDS = ("metrics.jsonl", "samples.jsonl", "timelines.jsonl")
LOCK_FILE = "launch.lock"
NODES_DIR = "launch.nodes"
HEARTBEAT_S = 10.0
STALE_S = 60.0          # a node file untouched this long belongs to a launch that ended
JOIN_S = 10.0           # how long a node waits for another taking the lock right now
_LAUNCH_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def check_launch_id(launch_id: str) -> str:
    """``launch_id`` if it is a valid file name part (letters, digits, '.', '_', '-');
    ValueError saying what to write otherwise."""
    if not _LAUNCH_ID.match(launch_id):
        raise ValueError(f"DTDSL_LAUNCH_ID={launch_id!r}: write 1 to 128 letters, digits, "
                         "'.', '_' or '-' (it names files in the run directory)")
    return launch_id


class RunDirBusy(Exception):
    """Another launch holds the run directory (the message names it)."""


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) the lock: one node of one launch."""

    launch: str
    host: str
    pid: int
    started: float = 0.0

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started)) \
            if self.started else "?"
        return f"launch {self.launch} (host {self.host}, pid {self.pid}, since {when})"

    @staticmethod
    def parse(text: str) -> Holder | None:
        try:
            d = json.loads(text)
            return Holder(launch=str(d["launch"]), host=str(d["host"]), pid=int(d["pid"]),
                          started=float(d.get("started", 0.0)))
        except (ValueError, KeyError, TypeError):
            return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _node_name(host: str, pid: int) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", host)[:64] + f"-{pid}"


class RunDirLock:
    """The lock of ``run_dir`` for one node of launch ``launch_id`` (module docstring):
    ``acquire``, then ``heartbeat`` every ``HEARTBEAT_S``, ``release`` at the end.
    ``first`` says whether this node started the launch's hold (no node of it held the
    lock before: the launch begins, or begins again after all its nodes had ended)."""

    def __init__(self, run_dir: str | Path, launch_id: str, *, pid: int | None = None,
                 host: str | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.me = Holder(launch=check_launch_id(launch_id), host=host or socket.gethostname(),
                         pid=os.getpid() if pid is None else pid, started=time.time())
        self.path = self.run_dir / LOCK_FILE
        self.node = self.run_dir / NODES_DIR / _node_name(self.me.host, self.me.pid)
        self.fd: int | None = None
        self.first = False
        self.flock = True           # whether flock works on this file system

    # -- taking it ------------------------------------------------------------------------

    def acquire(self, join_s: float = JOIN_S) -> None:
        """Take the lock or join this launch's hold; RunDirBusy naming the holder when
        another launch holds it; OSError when the run directory cannot be written."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        self.fd = fd
        try:
            self._acquire(fd, time.monotonic() + join_s)
        except BaseException:
            self.fd = None
            os.close(fd)
            raise
        self._write_node()

    def _acquire(self, fd: int, deadline: float) -> None:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if self._join(fd):
                    return
                if time.monotonic() > deadline:
                    raise RunDirBusy(self._busy(self._record(fd))) from None
                time.sleep(0.05)
                continue
            except OSError as err:
                if err.errno not in _NO_FLOCK:
                    raise
                self.flock = False
            self._claim(fd)
            return

    def _join(self, fd: int) -> bool:
        """With an exclusive flock refused: True when this launch holds it (joined, a
        shared lock taken); False when another node takes it right now; RunDirBusy when
        another launch holds it."""
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False        # an exclusive holder: a node taking it this instant
        holder = self._record(fd)
        if holder is not None and holder.launch == self.me.launch:
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
        raise RunDirBusy(self._busy(holder))

    def _claim(self, fd: int) -> None:
        """No holder flock can see: refuse for a live node of another launch that flock
        cannot see, else write this launch's record and hold the lock shared."""
        live = self._live_nodes()
        if live:
            if self.flock:
                fcntl.flock(fd, fcntl.LOCK_UN)
            raise RunDirBusy(self._busy(live[0], heard=True))
        old = self._record(fd)
        self.first = True
        if old is None or old.launch != self.me.launch or self.flock:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(asdict(self.me)) + "\n").encode(), 0)
            os.fsync(fd)
        if self.flock:
            # A conversion is not atomic, but every other taker meets this node's file
            # (written next, before it can look) or this record, and refuses.
            self._write_node()
            fcntl.flock(fd, fcntl.LOCK_SH)

    def _live_nodes(self) -> list[Holder]:
        """Node files of other launches that may be alive (removing those that are not)."""
        live = []
        try:
            entries = list((self.run_dir / NODES_DIR).iterdir())
        except OSError:
            return []
        for path in entries:
            try:
                holder = Holder.parse(path.read_text("utf-8"))
                age = time.time() - path.stat().st_mtime
            except OSError:
                continue
            if holder is None or holder.launch == self.me.launch and (
                    holder.host != self.me.host or _alive(holder.pid)):
                continue
            # On this host the process must live too (a node of a launch that was
            # killed a moment ago is not waited for); another host's cannot be asked.
            if age < STALE_S and (holder.host != self.me.host or _alive(holder.pid)):
                live.append(holder)
            else:
                with contextlib.suppress(OSError):
                    path.unlink()
        return live

    def _record(self, fd: int) -> Holder | None:
        try:
            return Holder.parse(os.pread(fd, 4096, 0).decode("utf-8", errors="replace"))
        except OSError:
            return None

    def _busy(self, holder: Holder | None, heard: bool = False) -> str:
        where = f"{self.run_dir} is in use by "
        if holder is None:
            return where + (f"another launch (its record in {self.path} is unreadable): "
                            "wait for it to end, or choose another --run-dir")
        said = where + holder.describe()
        if holder.host == self.me.host and not _alive(holder.pid):
            said += (f"; its supervisor has exited but processes it started still hold "
                     f"{self.path} (see: fuser -v {self.path})")
        elif heard:
            said += f", heard from within the last {STALE_S:.0f} s"
        return said + ": wait for it to end, or choose another --run-dir"

    # -- holding it -----------------------------------------------------------------------

    def _write_node(self) -> None:
        self.node.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.node.with_name(self.node.name + ".tmp")
        tmp.write_text(json.dumps(asdict(self.me)) + "\n", "utf-8")
        os.replace(tmp, self.node)

    def heartbeat(self) -> None:
        """Tell other hosts this node of the launch is alive (its node file's time)."""
        try:
            os.utime(self.node)
        except FileNotFoundError:
            with contextlib.suppress(OSError):
                self._write_node()
        except OSError:
            pass

    def inheritable_fd(self) -> int:
        """The lock's descriptor, inheritable: give it to the processes this launch
        starts (``pass_fds``) so that they hold the lock as long as they run."""
        assert self.fd is not None, "acquire first"
        os.set_inheritable(self.fd, True)
        return self.fd

    def release(self) -> None:
        """This node's part of the hold ends (its node file goes; the flock with the last
        process holding the descriptor)."""
        with contextlib.suppress(OSError):
            self.node.unlink()
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None
