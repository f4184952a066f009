"""Source files and spans: where every diagnostic points.

A spec is read as bytes and decoded here, so that encoding problems become
diagnostics with a location instead of exceptions.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from dtdsl.codes import DT001, DT002, DT003

__all__ = ["MAX_SPEC_BYTES", "Source", "Span", "SourceError", "decode_source"]

# A real spec is a few KB; 128 KiB is forty times that. The cap bounds the time a
# hostile input (megabytes of junk, tens of thousands of statements) can take.
MAX_SPEC_BYTES = 128 << 10


class Span(BaseModel):
    """A region of a source file: 1-based lines and columns, end column exclusive."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    line: int
    column: int
    end_line: int
    end_column: int

    @classmethod
    def point(cls, line: int, column: int) -> Span:
        return cls(line=line, column=column, end_line=line, end_column=column + 1)

    def __str__(self) -> str:
        return f"{self.line}:{self.column}"


class Source(BaseModel):
    """A decoded spec: its display name and text."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    text: str

    def lines(self) -> list[str]:
        """The text split into lines, without line breaks."""
        return [line.rstrip("\r") for line in self.text.split("\n")]

    def end_span(self) -> Span:
        """A one-character span just past the last character of the file."""
        lines = self.text.split("\n")
        return Span.point(len(lines), len(lines[-1].rstrip("\r")) + 1)


class SourceError(BaseModel):
    """Why raw bytes are not a spec: a code, a message and a location."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    code: str
    message: str
    span: Span
    hint: str | None = None


def _position(data: bytes, offset: int) -> tuple[int, int]:
    """Line and column (1-based, counted in bytes) of a byte offset."""
    line = data.count(b"\n", 0, offset) + 1
    column = offset - (data.rfind(b"\n", 0, offset) + 1) + 1
    return line, column


def decode_source(name: str, data: bytes) -> Source | SourceError:
    """Decode a spec's bytes, or say why they are not a spec."""
    if len(data) > MAX_SPEC_BYTES:
        return SourceError(
            code=DT003,
            message=f"spec is more than {MAX_SPEC_BYTES:,} bytes, the limit of a spec",
            span=Span.point(1, 1),
            hint="a spec describes a job in a few hundred lines; keep measured data in a "
            "separate file and read it with empirical(\"file.json\")",
        )
    nul = data.find(b"\0")
    if nul >= 0:
        line, column = _position(data, nul)
        return SourceError(
            code=DT002,
            message="spec contains a NUL byte: this looks like a binary file, not a .dt spec",
            span=Span.point(line, column),
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line, column = _position(data, err.start)
        return SourceError(
            code=DT001,
            message=f"spec is not valid UTF-8: byte 0x{data[err.start]:02x} cannot start or "
            "continue a character here",
            span=Span.point(line, column),
            hint="save the file as UTF-8",
        )
    if text.startswith("\ufeff"):
        text = text[1:]
    if "\r" in text and "\n" not in text:     # classic Mac OS line endings: lone CRs
        text = text.replace("\r", "\n")
    return Source(name=name, text=text)
