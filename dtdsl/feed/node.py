"""A node's feed directory: where its trainers' and preprocessing workers' ``ipc://``
sockets live (``ir.job.FeedConfig``); ``launch.sh`` makes one per node."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["FEED_DIR_ENV", "feed_dir"]

# The environment variable that names a node's feed directory (launch.sh sets it).
FEED_DIR_ENV = "DTDSL_FEED_DIR"
# A Unix socket path holds at most 107 bytes on Linux (sun_path); the longest name below
# the feed directory is "trainer-NNNN".
_IPC_PATH_MAX = 107


def feed_dir(given: str | Path | None = None) -> Path:
    """The node's feed directory: ``given``, else ``$DTDSL_FEED_DIR``. ValueError when
    neither is set, or when the directory is missing or its socket paths would be too
    long for a Unix socket."""
    where = given if given is not None else os.environ.get(FEED_DIR_ENV)
    if not where:
        raise ValueError(f"no feed directory: launch.sh sets {FEED_DIR_ENV} (a node-local "
                         "directory for the workers' sockets); give --feed-dir or set it")
    path = Path(where).absolute()
    if not path.is_dir():
        raise ValueError(f"the feed directory {path} does not exist")
    if len(str(path / "trainer-0000").encode()) > _IPC_PATH_MAX:
        raise ValueError(f"the feed directory {path} is too long for Unix socket paths "
                         f"({_IPC_PATH_MAX} bytes): set TMPDIR to a shorter directory")
    return path
