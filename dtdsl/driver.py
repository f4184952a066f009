"""The compiler's linear driver: run the stages in order, stop after errors or at --emit.

    bytes --decode--> Source --parse--> AST --check--> Program --> (graph, plan, ... later)

Each stage is a function of its input that returns a new value and its
diagnostics; the driver never runs a stage after one that reported errors. The check
reads the files a spec names through the resolve stage (``resolve.SpecFiles``).
"""

from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dtdsl.codes import DT009
from dtdsl.diagnostics import Diagnostic, has_errors, sort_diagnostics
from dtdsl.errors import DtdslError
from dtdsl.frontend import ast
from dtdsl.frontend.check import check
from dtdsl.frontend.parser import parse
from dtdsl.ir.program import Program
from dtdsl.outdir import read_bounded
from dtdsl.resolve import SpecFiles
from dtdsl.source import MAX_SPEC_BYTES, Source, SourceError, decode_source

__all__ = ["STAGES", "FrontendResult", "UsageError", "read_spec", "run_frontend"]

STAGES = ("ast", "program")
MAX_DIAGNOSTICS = 1000  # per spec; hostile inputs can produce one per token


def _limit(diagnostics: tuple[Diagnostic, ...]) -> tuple[Diagnostic, ...]:
    if len(diagnostics) <= MAX_DIAGNOSTICS:
        return diagnostics
    cut = diagnostics[MAX_DIAGNOSTICS]
    return diagnostics[:MAX_DIAGNOSTICS] + (Diagnostic.error(
        DT009, f"too many problems: stopping after {MAX_DIAGNOSTICS}; "
        f"{len(diagnostics) - MAX_DIAGNOSTICS} more not reported", cut.span,
        hint="fix the first ones and check again"),)


class UsageError(DtdslError):
    """A problem with the command line rather than with a spec (exit code 2)."""


@dataclass(frozen=True)
class FrontendResult:
    name: str
    source: Source | None
    spec: ast.Spec | None
    program: Program | None
    diagnostics: tuple[Diagnostic, ...]

    @property
    def ok(self) -> bool:
        return not has_errors(self.diagnostics)


def read_spec(path: str) -> tuple[str, bytes]:
    """The display name and bytes of a spec path ('-' is standard input)."""
    if path == "-":
        return "<stdin>", sys.stdin.buffer.read(MAX_SPEC_BYTES + 1)
    try:
        # Only a regular file (a FIFO or a device would never end); a longer one than a
        # spec may be is read up to the bound, for decode_source to refuse (DT003).
        return path, read_bounded(path, MAX_SPEC_BYTES)
    except FileNotFoundError:
        raise UsageError(f"no such file: {path}") from None
    except OSError as err:
        raise UsageError(f"cannot read {path}: {err.strerror or err}") from None
    except ValueError as err:
        raise UsageError(f"{err}; give a .dt file") from None


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """The front end allocates many small acyclic objects; collecting mid-way only costs time
    (more than half of it on large inputs)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def run_frontend(name: str, data: bytes, *, stop_after: str = "program",
                 base_dir: Path | None = None) -> FrontendResult:
    """Decode, parse and check a spec, stopping at the first stage with errors."""
    assert stop_after in STAGES, stop_after
    decoded = decode_source(name, data)
    if isinstance(decoded, SourceError):
        diag = Diagnostic.error(decoded.code, decoded.message, decoded.span, hint=decoded.hint)
        return FrontendResult(name=name, source=None, spec=None, program=None,
                              diagnostics=(diag,))
    source = decoded
    with _gc_paused():
        parsed = parse(source)
        if parsed.spec is None or stop_after == "ast":
            return FrontendResult(name=name, source=source, spec=parsed.spec, program=None,
                                  diagnostics=_limit(sort_diagnostics(parsed.diagnostics)))
        if base_dir is None:
            base_dir = Path(name).resolve().parent if name != "<stdin>" else Path.cwd()
        checked = check(parsed.spec, source, files=SpecFiles(base_dir))
    return FrontendResult(name=name, source=source, spec=parsed.spec, program=checked.program,
                          diagnostics=_limit(parsed.diagnostics +
                                             sort_diagnostics(checked.diagnostics)))
