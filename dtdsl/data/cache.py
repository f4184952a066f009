"""Where the data layer keeps what it computes once (indexes of WebDataset shards and
LLaVA JSON, token counts per tokenizer), and how it writes them: JSON in ``.dtdsl-index/``
beside the data when that folder is writable, else under ``$XDG_CACHE_HOME/dtdsl/index/``;
written whole or not at all (a temporary file moved into place)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["cache_path", "read_cache", "user_cache_dir", "write_cache"]


def user_cache_dir() -> Path:
    """The user's cache folder for what the data layer computes."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dtdsl" / "index"


def cache_path(beside: Path, name: str, cache_dir: str | Path | None = None) -> Path:
    """The cache file ``name`` for data in folder ``beside`` (``cache_dir``: there instead)."""
    if cache_dir is not None:
        return Path(cache_dir) / name
    folder = beside / ".dtdsl-index"
    if os.access(beside, os.W_OK) or folder.is_dir():
        return folder / name
    return user_cache_dir() / name


def read_cache(path: Path, fmt: str, version: int) -> dict[str, Any] | None:
    """The cached JSON object at ``path`` when it is of this format and version; None when
    there is none or it cannot be read (it is made again)."""
    from dtdsl.data.paths import Refused, read_regular

    if not path.is_file():
        return None
    try:
        data = json.loads(read_regular(path))
    except (OSError, ValueError, Refused):
        return None
    if not isinstance(data, dict) or data.get("format") != fmt or \
            data.get("version") != version:
        return None
    return data


def write_cache(path: Path, body: dict[str, Any]) -> bool:
    """Write ``body`` as compact JSON at ``path``, whole; False when it cannot be written
    (the caller goes on without a cache)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".{os.getpid()}.partial")
        tmp.write_text(json.dumps(body, separators=(",", ":")))
        os.replace(tmp, path)
    except OSError:
        return False
    return True
