"""Every diagnostic code the compiler emits is documented, and the docs are current."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from dtdsl import codes
from dtdsl.codes import CODES, explain, markdown

ROOT = Path(__file__).resolve().parent.parent


def test_every_emitted_code_is_documented_and_vice_versa():
    """Code is written with the names (``from dtdsl.codes import DT601``), never a string:
    a misspelt name fails at import. Every name is a documented code and every
    documented code is emitted somewhere."""
    names = {n for n in vars(codes) if re.fullmatch(r"DT\d{3}", n)}
    assert names == set(CODES) and all(getattr(codes, n) == n for n in names)
    used, literals = set(), []
    for path in (ROOT / "dtdsl").rglob("*.py"):
        if path.name == "codes.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "dtdsl.codes":
                used |= {a.name for a in node.names if re.fullmatch(r"DT\d{3}", a.name)}
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    re.fullmatch(r"DT\d{3}", node.value):
                literals.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not literals, f"write the code's name, not a string: {literals}"
    assert set(CODES) - used == set(), sorted(set(CODES) - used)


def test_docs_are_generated_from_the_registry():
    doc = ROOT / "docs" / "diagnostics.md"
    assert doc.read_text() == markdown(), "run: python -m dtdsl.codes > docs/diagnostics.md"


def test_explain():
    assert explain("dt305").startswith("DT305: Inconsistent architecture")
    assert explain("DT999") is None
