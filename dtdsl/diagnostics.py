"""Diagnostics: every user mistake, with a code, a location and a way out.

Passes collect diagnostics instead of raising; the driver stops after a stage
that reported errors. Rendering is here too: the compiler-style text form
(``file:line:col: error[DT203]: ...`` with the source line and a caret) and
the JSON form of ``--format json``.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable, Sequence
from enum import Enum

from pydantic import BaseModel, ConfigDict

from dtdsl.source import Source, Span

__all__ = [
    "Diagnostic",
    "Severity",
    "MAX_SHOWN",
    "did_you_mean",
    "sort_diagnostics",
    "has_errors",
    "render_json",
    "render_text",
]

_MAX_SHOWN_LINE = 100  # characters of a source line shown around the caret
_MAX_SHOWN_MESSAGE = 1000  # characters of a message, note or hint (the rest counted)
MAX_SHOWN = 100  # diagnostics shown in full per file on the terminal


class Severity(str, Enum):
    ERROR = "error"
    WARNING = "warning"


class Diagnostic(BaseModel):
    """One finding about a spec."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    code: str
    severity: Severity
    message: str
    span: Span
    notes: tuple[str, ...] = ()
    hint: str | None = None

    @classmethod
    def error(cls, code: str, message: str, span: Span, *, notes: Sequence[str] = (),
              hint: str | None = None) -> Diagnostic:
        return cls(code=code, severity=Severity.ERROR, message=message, span=span,
                   notes=tuple(notes), hint=hint)

    @classmethod
    def warning(cls, code: str, message: str, span: Span, *, notes: Sequence[str] = (),
                hint: str | None = None) -> Diagnostic:
        return cls(code=code, severity=Severity.WARNING, message=message, span=span,
                   notes=tuple(notes), hint=hint)


def has_errors(diagnostics: Iterable[Diagnostic]) -> bool:
    return any(d.severity is Severity.ERROR for d in diagnostics)


def sort_diagnostics(diagnostics: Iterable[Diagnostic]) -> tuple[Diagnostic, ...]:
    """In source order (stable for diagnostics at the same place)."""
    return tuple(sorted(diagnostics, key=lambda d: (d.span.line, d.span.column)))


def did_you_mean(word: str, choices: Iterable[str]) -> str | None:
    """The closest of ``choices`` to ``word``, if one is close enough to suggest."""
    choices = list(choices)
    lowered = {c.lower(): c for c in choices}
    if word.lower() in lowered:
        return lowered[word.lower()]
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if not close:
        close = difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=0.6)
        close = [lowered[c] for c in close]
    return close[0] if close else None


def _printable(text: str) -> str:
    """Replace characters that would garble a terminal, one for one (carets stay aligned)."""
    return "".join(c if c.isprintable() or c == " " else "?" for c in text.expandtabs(1))


def _shown(text: str) -> str:
    """A message, note or hint as one printable line of at most ``_MAX_SHOWN_MESSAGE``
    characters (a name or path from the input may be anything, and any length)."""
    if len(text) > _MAX_SHOWN_MESSAGE:
        text = f"{text[:_MAX_SHOWN_MESSAGE]}... ({len(text) - _MAX_SHOWN_MESSAGE:,} more " \
               "characters)"
    return _printable(text)


def _excerpt(lines: Sequence[str], span: Span) -> list[str]:
    if not 1 <= span.line <= len(lines):
        return []
    line_text = lines[span.line - 1]
    start = max(span.column - 1, 0)
    if span.end_line == span.line:
        width = max(span.end_column - span.column, 1)
    else:
        width = max(len(line_text) - start, 1)
    # Long lines (minified or junk input): show a window around the caret.
    offset = 0
    if len(line_text) > _MAX_SHOWN_LINE:
        offset = max(0, min(start - _MAX_SHOWN_LINE // 3, len(line_text) - _MAX_SHOWN_LINE))
        line_text = line_text[offset:offset + _MAX_SHOWN_LINE]
    line_text = _printable(line_text)
    caret_start = start - offset
    width = max(1, min(width, len(line_text) - caret_start if len(line_text) > caret_start else 1))
    gutter = str(span.line)
    pad = " " * len(gutter)
    return [
        f"{pad} |",
        f"{gutter} | {line_text}",
        f"{pad} | {' ' * caret_start}{'^' * width}",
    ]


def render_text(diagnostics: Sequence[Diagnostic], source: Source | None, name: str,
                limit: int = MAX_SHOWN) -> str:
    """Compiler-style text: location, severity, code and message; source line with caret.

    At most ``limit`` diagnostics are shown in full; the count line says how many more.
    """
    blocks = []
    source_lines = source.lines() if source is not None else []
    for diag in diagnostics[:limit]:
        lines = [f"{name}:{diag.span.line}:{diag.span.column}: "
                 f"{diag.severity.value}[{diag.code}]: {_shown(diag.message)}"]
        if source is not None:
            lines += _excerpt(source_lines, diag.span)
        lines += [f"  = note: {_shown(note)}" for note in diag.notes]
        if diag.hint:
            lines.append(f"  = hint: {_shown(diag.hint)}")
        blocks.append("\n".join(lines))
    errors = sum(d.severity is Severity.ERROR for d in diagnostics)
    warnings = len(diagnostics) - errors
    if len(diagnostics) > limit:
        blocks.append(f"... {len(diagnostics) - limit} more not shown "
                      "(--format json lists them all)")
    if errors or warnings:
        blocks.append(f"{name}: {_count(errors, 'error')}, {_count(warnings, 'warning')}")
    return "\n\n".join(blocks) + ("\n" if blocks else "")


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def diagnostic_record(diag: Diagnostic, file: str) -> dict:
    """The JSON object of one diagnostic, as documented for ``--format json``."""
    return {
        "code": diag.code,
        "severity": diag.severity.value,
        "message": diag.message,
        "file": file,
        "line": diag.span.line,
        "column": diag.span.column,
        "end_line": diag.span.end_line,
        "end_column": diag.span.end_column,
        "notes": list(diag.notes),
        "hint": diag.hint,
    }


def render_json(results: Sequence[tuple[str, Sequence[Diagnostic]]]) -> str:
    """``{"diagnostics": [...], "errors": N, "warnings": N}`` over one or more files."""
    records = [diagnostic_record(d, file) for file, diags in results for d in diags]
    errors = sum(r["severity"] == "error" for r in records)
    return json.dumps({"diagnostics": records, "errors": errors,
                       "warnings": len(records) - errors}, indent=2) + "\n"
