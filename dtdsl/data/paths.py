"""Files a dataset names, found and opened only where they belong.

A dataset names files: a LLaVA JSON its images (under the image folder), a WebDataset
source its shards (in a folder, or by a pattern), a dtdsl index its shards (in its own
folder). Those names are data, and data may be hostile or broken: ``../../etc/passwd``,
``/etc/shadow``, a symlink that leads out of the folder, a FIFO or a device that blocks
whoever opens it. So a named file is taken only when

- the name is relative and stays inside its folder once resolved (``..`` and symlinks
  followed): a symlink inside the folder to a file inside it is fine, one that leads out
  is not;
- it is a regular file (``os.stat`` before anything opens it: a FIFO, a socket, a device
  or a directory is refused without blocking);

and it is opened with ``O_NONBLOCK | O_NOFOLLOW`` and checked again on the open file
(``fstat``), so a file swapped for a FIFO or a symlink after the check is refused too,
never waited on. A refused file is a ``Refused`` whose ``reason`` is a short phrase the
indexes count by (``"outside its folder"``, ``"not a regular file"``, ...) and whose
message names the file.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO

from dtdsl.outdir import file_kind

__all__ = ["ABSOLUTE", "MISSING", "NOT_REGULAR", "OUTSIDE", "Refused", "inside",
           "open_regular", "read_regular", "regular_file"]

ABSOLUTE = "absolute path"
OUTSIDE = "outside its folder"
NOT_REGULAR = "not a regular file"
MISSING = "missing"


class Refused(Exception):
    """A file a dataset names that is not read: ``reason`` (counted), the message says
    which file and why."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def inside(folder: str | os.PathLike[str], name: str) -> Path:
    """The regular file ``name`` (relative) names inside ``folder``, resolved; ``Refused``
    when it is absolute, leads out of ``folder`` (by ``..`` or through a symlink), is
    missing or is not a regular file. Nothing is opened."""
    base = os.path.realpath(folder)
    if not isinstance(name, str) or not name or "\0" in name:
        raise Refused(NOT_REGULAR, f"{name!r} is not a file name")
    if os.path.isabs(name) or name.startswith("~"):
        raise Refused(ABSOLUTE, f"{name} is an absolute path; paths here are relative to "
                      f"{base}")
    joined = os.path.join(base, name)
    if not _within(os.path.normpath(joined), base):
        raise Refused(OUTSIDE, f"{name} leads out of {base}")
    real = os.path.realpath(joined)
    if not _within(real, base):
        raise Refused(OUTSIDE, f"{name} leads out of {base} through a symlink (to {real})")
    return regular_file(real, shown=os.path.join(base, name))


def regular_file(path: str | os.PathLike[str], *, shown: str | None = None) -> Path:
    """``path`` when it is a regular file (symlinks followed); ``Refused`` when it is
    missing or anything else. Nothing is opened, so a FIFO does not block."""
    where = shown or str(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise Refused(MISSING, f"no such file: {where}") from None
    except (OSError, ValueError) as err:
        raise Refused(NOT_REGULAR, f"cannot read {where}: "
                      f"{getattr(err, 'strerror', None) or err}") from None
    if not stat.S_ISREG(st.st_mode):
        raise Refused(NOT_REGULAR, f"{where} is {file_kind(st.st_mode)}, not a regular file")
    return Path(path)


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """``path`` opened for reading only if it is a regular file now: opened without
    blocking and without following a last symlink, then checked on the open file
    (``Refused`` otherwise; OSError for what the system says)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags | getattr(os, "O_NOFOLLOW", 0))
    except OSError as err:
        if err.errno == errno.ELOOP:
            # A symlink as the last part: follow it only to a regular file.
            regular_file(path)
            fd = os.open(os.path.realpath(path), flags | getattr(os, "O_NOFOLLOW", 0))
        else:
            raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise Refused(NOT_REGULAR, f"{path} is {file_kind(mode)}, not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike[str]) -> bytes:
    """The bytes of ``path`` if it is a regular file (``open_regular``)."""
    with open_regular(path) as f:
        return f.read()
