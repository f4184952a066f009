"""The tiny spec and variants of it, for the runtime tests."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from dtdsl.driver import run_frontend
from dtdsl.ir import program as ir

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "specs" / "tiny_cpu.dt"


@cache
def program(text: str | None = None) -> ir.Program:
    """tiny_cpu.dt, or ``text`` checked under its name."""
    data = TINY.read_bytes() if text is None else text.encode()
    result = run_frontend(str(TINY), data)
    assert result.ok, [d.message for d in result.diagnostics]
    return result.program


def variant(old: str, new: str) -> ir.Program:
    """tiny_cpu.dt with one piece of text replaced."""
    text = TINY.read_text()
    assert old in text
    return program(text.replace(old, new))


def small(batch: int = 8) -> ir.Program:
    """The tiny spec with a smaller global batch: the same model, faster steps."""
    p = program()
    return p.model_copy(update={"train": p.train.model_copy(update={"global_batch": batch})})
