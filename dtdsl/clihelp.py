"""What ``dtc`` and ``dtc data`` share: exit codes (from ``errors``), argparse types,
loading a spec, writing a file whole.

It lives apart from ``dtdsl.cli`` so that ``dtdsl.data.cli`` can use it without importing
``dtdsl.cli`` (which imports ``dtdsl.data.cli``): no import cycle between the two commands.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

from dtdsl.diagnostics import render_text
from dtdsl.driver import FrontendResult, UsageError, read_spec, run_frontend
from dtdsl.errors import EXIT_ERRORS, EXIT_INTERNAL, EXIT_OK, EXIT_USAGE
from dtdsl.ir.bounds import MAX_CLUSTER_GPUS

__all__ = [
    "EXIT_ERRORS", "EXIT_INTERNAL", "EXIT_OK", "EXIT_USAGE", "int_at_least", "load_program",
    "gpu_count", "non_negative", "positive_int", "write_file",
]



def int_at_least(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number of at least ``low`` (and at most ``high``)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, not {text!r}") \
                from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected at least {low}, not {value}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"expected at most {high:,}, not {value:,}")
        return value
    return parse


positive_int = int_at_least(1)
non_negative = int_at_least(0)
gpu_count = int_at_least(1, MAX_CLUSTER_GPUS)        # --gpus: as a cluster block's gpus


def load_program(path: str) -> tuple[FrontendResult | None, int]:
    """Check one spec for a command that needs its Program: the result, or None and the
    exit code after reporting why (diagnostics, warnings too, on stderr)."""
    try:
        name, data = read_spec(path)
    except UsageError as err:
        print(f"dtc: error: {err}", file=sys.stderr)
        return None, EXIT_USAGE
    result = run_frontend(name, data)
    if result.diagnostics:
        sys.stderr.write(render_text(result.diagnostics, result.source, result.name))
    if not result.ok or result.program is None:
        return None, EXIT_ERRORS
    return result, EXIT_OK


# An existing output file is read this far to tell whether dtdsl wrote it.
_OURS_READ = 64 << 20


def check_output(path: str, ours: Callable[[bytes], bool], what: str) -> Path:
    """``path`` as ``write_file`` may write it (before long work: ``dtc profile``): new,
    or a regular file ``ours`` recognises as ``what``; UsageError otherwise."""
    target = Path(path)
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        st = None
        if not target.parent.is_dir():
            raise UsageError(f"cannot write {path}: no folder {target.parent}") from None
    except OSError as err:
        raise UsageError(f"cannot write {path}: {err.strerror or err}") from None
    if st is not None:
        if stat.S_ISLNK(st.st_mode):
            raise UsageError(f"{path} is a symbolic link; dtdsl does not write through "
                             "links: give another file name")
        if stat.S_ISDIR(st.st_mode):
            raise UsageError(f"{path} is a directory; give a file name")
        if not stat.S_ISREG(st.st_mode) or st.st_size > _OURS_READ or \
                not ours(_read(target)):
            raise UsageError(f"{path} exists and is not {what} dtdsl wrote; nothing was "
                             "changed: give another file name, or remove it first")
    return target


def parses_as(model: Any) -> Callable[[bytes], bool]:
    """``write_file``'s ``ours`` for a JSON file of a pydantic ``model`` (a plan, a
    profile): whether the bytes validate as one."""
    def ours(data: bytes) -> bool:
        try:
            model.model_validate_json(data)
        except ValueError:
            return False
        return True
    return ours


def write_file(path: str, text: str, ours: Callable[[bytes], bool], what: str) -> None:
    """Write a whole file or nothing (``replacing``). An existing file is replaced only
    where ``ours`` recognises its bytes as ``what`` this command writes (dtdsl never writes
    over a file it did not write): a link, a folder or another file is a UsageError, and
    nothing changes."""
    with replacing(check_output(path, ours, what)) as f:
        f.write(text)


@contextlib.contextmanager
def replacing(target: Path, mode: int = 0o644) -> Iterator[TextIO]:
    """A text file whose lines become ``target`` whole (``mode``) when the block ends: a
    temporary file beside it, renamed into place; removed if the block raises, ``target``
    left as it was. ``check_output`` first: this replaces whatever is there."""
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent if str(target.parent) else ".",
                                   prefix=f".{target.name}.", suffix=".tmp")
    except OSError as err:
        raise UsageError(f"cannot write {target}: {err.strerror or err}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            os.fchmod(f.fileno(), mode)
            yield f
        os.replace(tmp, target)
    except BaseException as err:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(err, OSError):
            raise UsageError(f"cannot write {target}: {err.strerror or err}") from None
        raise


def _read(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(_OURS_READ + 1)
    except OSError:
        return b""
