"""No file over ``MAX_FILE_LINES`` lines and no function over ``MAX_FUNCTION_LINES`` in
``dtdsl/`` (issue 33, item 4): a long room is split along its own seams.

``DEBT`` lists the rooms that are longer today, each with its length now. It is a
ratchet, as ``tests/test_layers.py``'s is: a listed room may shrink but not grow, a new
long one fails, and an entry whose room is back under the limit (or gone) fails until
it is deleted, so the list can only shrink.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "dtdsl"
MAX_FILE_LINES = 900
MAX_FUNCTION_LINES = 100

# "path" for a file, "path::function" (qualified name) for a function: its lines today.
DEBT: dict[str, int] = {
}


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, lines) of every function in ``tree``, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            name = f"{prefix}{node.name}"
            yield name, node.end_lineno - node.lineno + 1
            yield from _functions(node, f"{name}.")


@functools.cache
def measure() -> dict[str, int]:
    """Every file and function of ``dtdsl/`` over its limit, with its length (read once
    per test process)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text(encoding="utf-8")
        lines = len(text.splitlines())
        if lines > MAX_FILE_LINES:
            out[rel] = lines
        for name, length in _functions(ast.parse(text)):
            if length > MAX_FUNCTION_LINES:
                out[f"{rel}::{name}"] = length
    return out


def test_no_long_file_or_function_beyond_the_listed_debt():
    found = measure()
    new = {k: v for k, v in found.items() if k not in DEBT}
    assert not new, (f"over {MAX_FILE_LINES} lines a file or {MAX_FUNCTION_LINES} a "
                     f"function: {new}; split it along its seams")
    grown = {k: (DEBT[k], v) for k, v in found.items() if k in DEBT and v > DEBT[k]}
    assert not grown, f"listed long rooms grew (listed, now): {grown}; split them instead"


def test_the_debt_list_only_names_rooms_still_too_long():
    found = measure()
    paid = sorted(k for k in DEBT if k not in found)
    assert not paid, f"back under the limit: delete {paid} from DEBT"


def test_the_measure_sees_methods_and_nested_functions():
    tree = ast.parse("class A:\n    def f(self):\n        def g():\n            pass\n")
    assert dict(_functions(tree)) == {"A.f": 3, "A.f.g": 2}
