"""Where the data layer keeps what it computes once (indexes of WebDataset shards and
LLaVA JSON, token counts per tokenizer), and how it writes them: JSON in ``.dtdsl-index/``
beside the data when that folder is writable, else under ``$XDG_CACHE_HOME/dtdsl/index/``;
written whole or not at all (a temporary file moved into place).

A ``.dtdsl-index`` that is a symbolic link is not used (someone else's link could send the
cache, or read one, anywhere): the user's cache folder is used instead. The temporary file
is created new (``O_CREAT | O_EXCL | O_NOFOLLOW``, a name of its own) in a folder opened
without following a link, so nothing is written through a link someone placed. What a
cache holds is checked by its reader before it is trusted (a damaged one is made
again)."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

__all__ = ["cache_path", "is_count", "read_cache", "user_cache_dir", "write_cache"]


def user_cache_dir() -> Path:
    """The user's cache folder for what the data layer computes."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dtdsl" / "index"


def cache_path(beside: Path, name: str, cache_dir: str | Path | None = None) -> Path:
    """The cache file ``name`` for data in folder ``beside`` (``cache_dir``: there instead)."""
    if cache_dir is not None:
        return Path(cache_dir) / name
    folder = beside / ".dtdsl-index"
    if folder.is_symlink():         # someone's link: neither written through nor read
        return user_cache_dir() / name
    if os.access(beside, os.W_OK) or folder.is_dir():
        return folder / name
    return user_cache_dir() / name


def is_count(x: Any) -> bool:
    """Whether a value read from a cache is a count (an int, not a bool, at least 0)."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def read_cache(path: Path, fmt: str, version: int) -> dict[str, Any] | None:
    """The cached JSON object at ``path`` when it is of this format and version; None when
    there is none or it cannot be read (it is made again)."""
    from dtdsl.data.paths import Refused, read_regular

    if path.parent.name == ".dtdsl-index" and path.parent.is_symlink():
        return None
    if not path.is_file():
        return None
    try:
        data = json.loads(read_regular(path))
    except (OSError, ValueError, RecursionError, Refused):
        return None
    if not isinstance(data, dict) or data.get("format") != fmt or \
            data.get("version") != version:
        return None
    return data


def write_cache(path: Path, body: dict[str, Any]) -> bool:
    """Write ``body`` as compact JSON at ``path``, whole; False when it cannot be written
    (the caller goes on without a cache)."""
    data = json.dumps(body, separators=(",", ":")).encode()
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
    if path.parent.name == ".dtdsl-index":      # beside the data: never through a link
        flags |= getattr(os, "O_NOFOLLOW", 0)
    tmp = f"{path.name}.{os.getpid()}.{secrets.token_hex(6)}.partial"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        folder = os.open(path.parent, flags)
    except OSError:
        return False
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0),
                     0o644, dir_fd=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path.name, src_dir_fd=folder, dst_dir_fd=folder)
        except OSError:
            try:
                os.unlink(tmp, dir_fd=folder)
            except OSError:
                pass
            raise
    except OSError:
        return False
    finally:
        os.close(folder)
    return True
