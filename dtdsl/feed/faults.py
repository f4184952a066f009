"""Faults no restart can change: how a trainer rank or a preprocessing worker ends its
launch with one line, instead of torchrun restarting the job into the same error.

torchrun restarts every rank when one fails (up to ``--max-restarts``) and the job resumes
from its newest checkpoint: right for a killed rank or a lost peer, wrong for an error that
will happen again the same way (a changed spec on ``--resume``, a job key others may read,
a full disk, bad weights or data, a stale bundle). Those end the launch:

1. The process that meets one (``fatal_cause`` tells them apart) writes the launch's
   *fatal record*: one line, who and why, at ``$DTDSL_FATAL_FILE`` (``launch.sh`` sets it
   to ``RUN_DIR/logs/fatal-<launch id>.txt``, on the run directory every node shares).
   The first writer wins: the record is made whole under a temporary name and linked into
   place (``link`` fails on an existing name, also over NFS), and never replaced. A
   node-local copy goes to ``$DTDSL_FATAL_LOCAL`` (in the node's feed directory): it
   tells the node's supervisor that the fault was met on its node, and stands in when
   the run directory cannot take the record (the disk is full).
2. It then holds (sleeps, at most ``HOLD_S``) instead of exiting: an exit would make
   torchrun restart the job at once, and its peers would print their own errors.
3. Every node's launch supervisor (``train.supervise``) polls for the record, stops its
   torchrun and ranks, prints the line once (the other nodes say "on another node") and
   exits with ``EXIT_FATAL``.

A rank that fails once a record exists holds too, quietly: its failure is a consequence
(a peer that stopped answering). Without ``DTDSL_FATAL_FILE`` (``train.py`` under a
torchrun of one's own) errors are raised as before.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["EXIT_FATAL", "FATAL_ENV", "FATAL_LOCAL_ENV", "HOLD_S", "Fatal", "die_with_parent",
           "fatal_cause", "fault_point", "hold_if_fatal", "one_line", "read_fatal",
           "record_fatal", "write_fatal"]

FATAL_ENV = "DTDSL_FATAL_FILE"          # the launch's fatal record (run directory)
FATAL_LOCAL_ENV = "DTDSL_FATAL_LOCAL"   # its node-local fallback (the feed directory)
EXIT_FATAL = 3          # launch.sh's exit status when a fault ended the launch
HOLD_S = 120.0          # how long a failing process waits to be stopped by its supervisor
MAX_LINE = 600          # a record's line is cut to this many characters

# What an OSError's errno says about the disk being written.
_DISK = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up",
         errno.EROFS: "the file system is read-only"}
# The same, where only the text crossed a process boundary (a rank's write error relayed
# to rank 0 as text by the checkpoint's exchange). torch's zip writer reports a short
# write on a full disk as "inline_container.cc:672 unexpected pos 704 vs 598".
_DISK_TEXT = ((re.compile(r"No space left on device"), _DISK[errno.ENOSPC]),
              (re.compile(r"Disk quota exceeded"), _DISK[errno.EDQUOT]),
              (re.compile(r"Read-only file system"), _DISK[errno.EROFS]),
              (re.compile(r"unexpected pos \d+ vs \d+"),
               "a write stopped short (the disk is most likely full or over quota)"))
_DISK_HINT = "; free space there, or choose another --run-dir"
# Errors of the user's inputs, by module and class: a module never imported raised none.
_INPUT_ERRORS = (("dtdsl.models.hf.fields", "HFError"), ("dtdsl.models.vae", "VAEError"),
                 ("dtdsl.data.shards", "DatasetError"), ("dtdsl.data.text", "TokenizerError"),
                 ("dtdsl.ir.checkpoint", "CheckpointMismatch"))


class Fatal(RuntimeError):
    """An error no restart can change (a stale bundle, a checkpoint of another spec): the
    launch stops with its message."""


def one_line(text: str) -> str:
    """``text`` on one line (whitespace runs collapsed), at most ``MAX_LINE`` characters."""
    line = " ".join(str(text).split())
    return line if len(line) <= MAX_LINE else line[:MAX_LINE - 3] + "..."


def _chain(err: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__      # type: ignore[assignment]


def _message(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


def fatal_cause(err: BaseException) -> str | None:
    """Why ``err`` (or an error it was raised from) cannot change on a restart, on one
    line; None when a restart may help (a lost peer, a timeout, a killed process)."""
    inputs = tuple(getattr(sys.modules[m], name) for m, name in _INPUT_ERRORS
                   if m in sys.modules and hasattr(sys.modules[m], name))
    chain = list(_chain(err))
    for e in chain:
        if isinstance(e, Fatal):
            return one_line(str(e))
        if isinstance(e, OSError) and e.errno in _DISK:
            return one_line(f"{_DISK[e.errno]}: {_message(e)}{_DISK_HINT}")
    for e in chain:
        if isinstance(e, PermissionError):
            return one_line(str(e) if str(e) else _message(e))
        if inputs and isinstance(e, inputs):
            return one_line(str(e))
    for e in chain:
        for pattern, what in _DISK_TEXT:
            if pattern.search(str(e)):
                return one_line(f"{what}: {_message(e)}{_DISK_HINT}")
    return None


def _link_record(path: Path, line: str) -> bool:
    """Write ``line`` at ``path`` unless a record is there; True when this one is."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError as err:
            if err.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS):
                raise
            # No hard links here: an exclusive create, its line written at once.
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(line + "\n")
        return True
    except FileExistsError:
        return False
    finally:
        try:
            tmp.unlink()
        except OSError:
            pass


def write_fatal(line: str, path: str | Path | None = None,
                local: str | Path | None = None) -> Path | None:
    """Record ``line`` as the launch's fatal record (module docstring), unless one is
    there already, at ``path`` (default ``$DTDSL_FATAL_FILE``: what every node's
    supervisor reads) and at ``local`` (default ``$DTDSL_FATAL_LOCAL``: this node's, which
    tells its supervisor the fault was met here, and stands in when ``path`` cannot be
    written). Returns where the record is, None when it could be written nowhere."""
    line = one_line(line)
    written = None
    shared = path or os.environ.get(FATAL_ENV)
    # This node's record first: a supervisor that finds the shared one must find it too,
    # or it would say "on another node" of its own node's fault.
    for where in (local or os.environ.get(FATAL_LOCAL_ENV), shared):
        if not where:
            continue
        try:
            _link_record(Path(where), line)
        except OSError:
            continue
        written = Path(where) if str(where) == str(shared) or written is None else written
    return written


def read_fatal(*paths: str | Path | None) -> str | None:
    """The line of the first of ``paths`` that holds a record (None: none does)."""
    for where in paths:
        if not where:
            continue
        try:
            text = Path(where).read_text("utf-8", errors="replace").strip()
        except OSError:
            continue
        if text:
            return one_line(text)
    return None


def record_fatal(who: str, cause: str) -> Path | None:
    """``write_fatal`` of ``who: cause`` where the launch says (None outside a launch)."""
    if not os.environ.get(FATAL_ENV):
        return None
    return write_fatal(f"{who}: {cause}")


def hold_if_fatal(err: BaseException, who: str, hold_s: float = HOLD_S) -> None:
    """Called with any error about to end this process (``who``: "rank 3"). When it cannot
    change on a restart, or the launch already has a fatal record (this failure follows
    from it), record it (the first record wins) and wait, silently, for the launch
    supervisor to stop this process, at most ``hold_s`` seconds; then return, and the
    caller raises as before. Returns at once outside a launch and for other errors."""
    shared, local = os.environ.get(FATAL_ENV), os.environ.get(FATAL_LOCAL_ENV)
    if not shared or getattr(err, "_dtdsl_held", False):
        return
    cause = fatal_cause(err)
    if cause is None and read_fatal(shared, local) is None:
        return
    if cause is not None and write_fatal(f"{who}: {cause}", shared, local) is None:
        return      # nowhere to say it: fail as before
    try:
        err._dtdsl_held = True      # type: ignore[attr-defined]
    except AttributeError:
        pass
    deadline = time.monotonic() + hold_s
    while time.monotonic() < deadline:
        time.sleep(0.5)


def fault_point(who: str, step: int, run_dir: Path) -> None:
    """SIGKILL this process when ``DTDSL_FAULT`` names ``who`` at ``step`` (once per
    run directory: a marker file records that it happened)."""
    spec = os.environ.get("DTDSL_FAULT", "")
    for item in filter(None, (s.strip() for s in spec.split(","))):
        target, _, at = item.partition("@")
        if target != who or not at.isdigit() or int(at) != step:
            continue
        marker = run_dir / "faults" / f"{who}@{step}"
        marker.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return
        os.close(fd)
        print(f"DTDSL_FAULT: killing {who} at step {step}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def die_with_parent(parent: int) -> Callable[[], None] | None:
    """A ``preexec_fn``: the child gets SIGTERM when its parent (a supervisor) dies
    (Linux), so that a supervisor killed with SIGKILL leaves no worker and no torchrun
    behind; elsewhere nothing."""
    def set_up() -> None:
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGTERM)       # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:              # it died before prctl
            os._exit(1)

    return set_up if sys.platform.startswith("linux") else None
