"""Typed, bounded reads of the JSON objects a model directory holds (``config.json``, a
scheduler's or a VAE's config, ``rope_scaling``): the one place their values are checked.

``Fields(cfg, defaults=...)`` reads one object key by key: ``integer``, ``number``,
``flag``, ``text``, ``integers`` (a list, or one value for every level), ``texts``,
``object`` (a nested object, read the same way). A key the object leaves out, or writes as
``null``, takes its ``defaults`` value (the library class's, as ``from_pretrained`` does).
A value of the wrong type, or outside its bounds, is an error that names the key, the
value and what it must be, raised before anything is built from it: no value from a file
reaches torch, pydantic or a loop unchecked.

The rules, the same for every key:

- an integer is a JSON integer: ``true`` is not one, and neither is ``32.0`` (transformers
  and diffusers would pass it to ``nn.Linear``, which refuses it too);
- a number is a JSON integer or float, finite (JSON's ``NaN`` and ``Infinity``, which
  Python reads, are refused);
- a flag is ``true`` or ``false`` (the string ``"false"`` is not: Python would take it as
  true);
- every integer has bounds, generous for any real model and small enough that the work
  dtdsl does with a value (meta modules, layer loops) stays bounded.

Files: ``open_regular`` opens a regular file (through symlinks) and refuses a FIFO, a
device or a folder without blocking on it; ``read_json`` reads a bounded JSON object from
one, with the sha256 of the bytes read.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

from dtdsl.errors import DtdslError

__all__ = ["Fields", "HFError", "named", "open_regular", "read_json", "shown"]

_MISSING = object()


class HFError(DtdslError, ValueError):
    """A Hugging Face directory dtdsl cannot read, with what to do about it."""

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint


def shown(value: Any, limit: int = 48, *, typed: bool = True) -> str:
    """A file's value as the file writes it (JSON), cut to ``limit`` characters, with its
    type where JSON's spelling hides it (``"2"`` is a string); a short string where a
    string belongs is ``named``."""
    try:
        text = json.dumps(value, allow_nan=True)
    except (TypeError, ValueError):
        text = repr(value)
    if len(text) > limit:
        text = text[:limit - 3] + "..."
    kind = {str: "a string", list: "a list", dict: "an object", bool: "a flag"}.get(
        type(value))
    return f"{text} ({kind})" if kind and typed else text


def named(value: Any) -> str:
    """A value where a name belongs (a model_type, a block type): a string as Python
    quotes it, anything else ``shown``."""
    return repr(value) if isinstance(value, str) and len(value) <= 64 else shown(value)


def _range(low: int | None, high: int | None) -> str:
    if high is None:
        return f"at least {low}"
    return f"from {low} to {high:,}".replace(",", "_")


class Fields:
    """One JSON object read key by key (module docstring). ``what`` names the object in
    errors (``config key``, ``scheduler config key``); ``prefix`` is the path of a nested
    object's keys (``rope_scaling.``); ``error`` makes the exception (default HFError)."""

    def __init__(self, data: Mapping[str, Any], *, defaults: Mapping[str, Any] | None = None,
                 what: str = "config key", prefix: str = "",
                 error: Callable[..., Exception] = HFError):
        self.data = data
        self.defaults = defaults or {}
        self.what = what
        self.prefix = prefix
        self.error = error

    # ---- the raw value and its error ------------------------------------------------

    def name(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def fail(self, key: str, value: Any, want: str, hint: str | None = None) -> Exception:
        """The error for ``key`` holding ``value`` where ``want`` was needed."""
        message = f"{self.what} {self.name(key)!r} is {shown(value)}, not {want}"
        return self.error(message, hint=hint) if hint else self.error(message)

    def raw(self, key: str, *, null_default: bool = True) -> Any:
        """The key's value; its default when the object leaves it out (or writes null,
        unless ``null_default`` is False: then null stays None)."""
        if key in self.data and (self.data[key] is not None or not null_default):
            return self.data[key]
        return self.defaults.get(key)

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    # ---- typed reads ------------------------------------------------------------------

    def integer(self, key: str, *, low: int = 1, high: int, optional: bool = False,
                null_default: bool = True) -> Any:
        """An integer in ``[low, high]`` (None when ``optional`` and there is none)."""
        value = self.raw(key, null_default=null_default)
        if value is None and optional:
            return None
        return self._integer(key, value, low, high)

    def _integer(self, key: str, value: Any, low: int, high: int, what: str = "") -> int:
        want = f"an integer {_range(low, high)}{what}"
        if isinstance(value, float) and value.is_integer():
            want += " (written without a decimal point)"
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise self.fail(key, value, want)
        return value

    def number(self, key: str, *, gt: float | None = None, ge: float | None = None,
               lt: float | None = None, le: float | None = None,
               optional: bool = False) -> Any:
        """A finite number within the bounds given (None when ``optional`` and none)."""
        value = self.raw(key)
        if value is None and optional:
            return None
        bounds = [f"above {gt:g}" if gt is not None else "",
                  f"at least {ge:g}" if ge is not None else "",
                  f"below {lt:g}" if lt is not None else "",
                  f"at most {le:g}" if le is not None else ""]
        bounds = [b for b in bounds if b]
        want = "a number " + " and ".join(bounds) if bounds else "a finite number"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(key, value, want)
        try:
            x = float(value)
        except OverflowError:          # an integer too large for a float
            raise self.fail(key, value, want) from None
        if not math.isfinite(x) or (gt is not None and not x > gt) or \
                (ge is not None and not x >= ge) or (lt is not None and not x < lt) or \
                (le is not None and not x <= le):
            raise self.fail(key, value, want)
        return x

    def flag(self, key: str) -> bool:
        value = self.raw(key)
        if not isinstance(value, bool):
            raise self.fail(key, value, "true or false")
        return value

    def text(self, key: str, *, optional: bool = False, max_len: int = 256) -> Any:
        """A string (None when ``optional`` and there is none); which strings are
        supported is the caller's to say, with the key's name."""
        value = self.raw(key)
        if value is None and optional:
            return None
        if not isinstance(value, str) or len(value) > max_len:
            raise self.fail(key, value, "a string")
        return value

    def integers(self, key: str, *, low: int = 1, high: int, count: int | None = None,
                 max_len: int = 64, per: str = "") -> tuple[int, ...]:
        """A list of integers in ``[low, high]``: of ``count`` of them when given (then
        one integer stands for all, as diffusers' per-level keys allow; ``per`` says
        what sets the count: " per level of block_out_channels"); at most ``max_len``
        otherwise."""
        value = self.raw(key)
        if count is not None and not isinstance(value, (list, tuple)):
            return (self._integer(key, value, low, high, f" or a list of {count}{per}"),) * count
        want = f"a list of {count if count is not None else f'1 to {max_len}'} integers " \
            f"{_range(low, high)}{per}"
        if not isinstance(value, (list, tuple)) or not value or len(value) > max_len or \
                (count is not None and len(value) != count):
            raise self.fail(key, value, want)
        for v in value:
            if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
                raise self.fail(key, value, want)
        return tuple(value)

    def texts(self, key: str, *, count: int, per: str = "") -> tuple[str, ...]:
        value = self.raw(key)
        if not isinstance(value, (list, tuple)) or len(value) != count or \
                not all(isinstance(v, str) for v in value):
            raise self.fail(key, value, f"a list of {count} strings{per}")
        return tuple(value)

    def object(self, key: str, *, defaults: Mapping[str, Any] | None = None) -> Any:
        """The nested object at ``key``, read the same way (None when there is none)."""
        value = self.data.get(key)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self.fail(key, value, "an object")
        return Fields(value, defaults=defaults, what=self.what,
                      prefix=f"{self.prefix}{key}.", error=self.error)

    def require(self, ok: bool, key: str, value: Any, want: str) -> None:
        """An error naming ``key`` unless ``ok`` (a rule between keys)."""
        if not ok:
            raise self.fail(key, value, want)


# ---- files -------------------------------------------------------------------------------

def open_regular(path: Path, *, error: Callable[..., Exception] = HFError) -> BinaryIO:
    """``path`` opened for reading, when it is a regular file (through symlinks: a Hub
    cache's ``snapshots/<rev>/`` names blobs elsewhere). A FIFO, a device or a folder is
    refused without blocking on it (opened non-blocking, then looked at)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        if os.path.islink(path):
            raise error(f"{path} is a symlink to {os.readlink(path)}, which is missing",
                        hint="an unfinished download? fetch the model again") from None
        raise error(f"{path} is missing") from None
    except OSError as err:
        raise error(f"cannot read {path}: {err.strerror or err}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) \
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket"
            raise error(f"{path} is {kind}, not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are each written once: libraries disagree on which of two
    values they read (Python's json the last), so neither is trusted."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        again = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"key {named(again)} is written twice in one object")
    return out


def read_json(path: Path, what: str, *, limit: int = 4 << 20,
              error: Callable[..., Exception] = HFError) -> tuple[dict[str, Any], str]:
    """The JSON object in ``path`` (a ``what``: "model config") and the sha256 of the
    bytes it was read from; an error for a file that is not a regular file, is larger than
    ``limit``, is not JSON, or holds something else than an object."""
    with open_regular(path, error=error) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise error(f"{path} is over {limit >> 20} MB; a {what} is a few KB")
    try:
        value = json.loads(data, object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise error(f"{path} is not valid JSON: {str(err)[:120]}") from None
    if not isinstance(value, dict):
        raise error(f"{path} holds a JSON {type(value).__name__}, not the object of a {what}")
    return value, hashlib.sha256(data).hexdigest()
