"""Golden diagnostics: each negative spec names the codes it must produce, inline.

A line ending in ``# expect: DT305 DT204`` must get exactly those errors, and
``# expect-warning: DT401`` those warnings; no other line may get any. The
rendered text of every spec is kept next to it in ``NAME.out`` (refresh with
``pytest --update-golden``).
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from dtdsl.diagnostics import render_text
from dtdsl.driver import run_frontend

HERE = Path(__file__).parent / "diagnostics"
CASES = sorted(HERE.glob("*.dt"))
_EXPECT = re.compile(r"#\s*expect(-warning)?:\s*((?:DT\d{3}\s*)+)")


def _expected(text: str) -> Counter:
    want: Counter = Counter()
    for number, line in enumerate(text.splitlines(), start=1):
        for m in _EXPECT.finditer(line):
            severity = "warning" if m.group(1) else "error"
            for code in m.group(2).split():
                want[(number, code, severity)] += 1
    return want


def test_there_are_cases():
    assert len(CASES) >= 10


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_expected_codes(path: Path):
    text = path.read_text()
    result = run_frontend(str(path.relative_to(HERE)), path.read_bytes(), base_dir=HERE)
    got = Counter((d.span.line, d.code, d.severity.value) for d in result.diagnostics)
    assert got == _expected(text), "\n" + render_text(result.diagnostics, result.source,
                                                      path.name)


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_rendered_text(path: Path, update_golden: bool):
    result = run_frontend(path.name, path.read_bytes(), base_dir=HERE)
    rendered = render_text(result.diagnostics, result.source, path.name)
    golden = path.with_suffix(".out")
    if update_golden:
        golden.write_text(rendered)
    assert golden.exists(), f"run pytest --update-golden to create {golden.name}"
    assert rendered == golden.read_text()
