"""Every diagnostic code the compiler emits is documented, and the docs are current."""

from __future__ import annotations

import re
from pathlib import Path

from dtdsl.codes import CODES, explain, markdown

ROOT = Path(__file__).resolve().parent.parent


def test_every_emitted_code_is_documented_and_vice_versa():
    used = set()
    for path in (ROOT / "dtdsl").rglob("*.py"):
        if path.name != "codes.py":
            used |= set(re.findall(r'"(DT\d{3})"', path.read_text()))
    assert used <= set(CODES), sorted(used - set(CODES))
    assert set(CODES) - used == set(), sorted(set(CODES) - used)


def test_docs_are_generated_from_the_registry():
    doc = ROOT / "docs" / "diagnostics.md"
    assert doc.read_text() == markdown(), "run: python -m dtdsl.codes > docs/diagnostics.md"


def test_explain():
    assert explain("dt305").startswith("DT305: Inconsistent architecture")
    assert explain("DT999") is None
