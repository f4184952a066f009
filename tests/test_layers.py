"""The layer order of dtdsl's packages, enforced over every import (issue 33).

Each module belongs to a layer; a module may import its own layer and the layers
its layer is allowed to see, never a higher one. Imports inside functions count
the same as module-level ones: a lazy import hides a dependency, it does not
remove it. Import cycles between modules fail too.

The order (DESIGN.md "Layer order"):

    base      source, diagnostics, codes, errors, outdir, resources, dtdsl/__init__
    compiler  ir < frontend < cost < report < planner < schedule < reorder < sim
              (ir sits below frontend: the checker builds ir.Program, ir imports
              no frontend; report renders Plans and Profiles, and sim uses it)
    runtime   models < parallel < data < feed < train; the runtime may also use
              base, ir, cost and reorder (the torch-free parts both sides share)
    resolve   dtdsl/resolve.py, the files a spec names read for the checker: base, ir,
              frontend, and the runtime up to data (models' HF configs and VAEs,
              data's tokenizers); frontend itself sees no runtime layer
    driver    the compiler's linear driver: base, ir, frontend, resolve
    codegen   emits the bundle for the runtime: everything above but the CLI
    cli       dtdsl/cli/ (a module per command), dtdsl/data/cli.py (``dtc data``),
              dtdsl/clihelp.py:
              anything

DEBT (and CYCLE_DEBT) list the violations that exist today (none), each with the
move that removes it. They are a ratchet, not a loosened check: any violation or
cycle not listed fails, and so does any entry that no longer occurs, so the lists
can only shrink. ``if TYPE_CHECKING:`` imports count: they are dependencies too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "dtdsl"

COMPILER = ["ir", "frontend", "cost", "schedule", "reorder", "report", "sim", "planner", "codegen"]
RUNTIME = ["models", "parallel", "data", "feed", "train"]
BASE = {"source", "diagnostics", "codes", "errors", "outdir", "resources", "__init__"}
CLI_MODULES = {"dtdsl.cli", "dtdsl.data.cli", "dtdsl.clihelp"}

# The (importer, imported) pairs that break the order today, grouped by the issue-33
# move that removes them. Delete an entry when its move lands (the test insists).
DEBT: dict[tuple[str, str], str] = {
}

# Import cycles that exist today (each a set of modules importing each other, lazily
# somewhere), with the move that breaks each. Same ratchet as DEBT.
CYCLE_DEBT: dict[frozenset[str], str] = {
}


def allowed_layers() -> dict[str, set[str]]:
    """Which layers each layer may import (its own included)."""
    allowed: dict[str, set[str]] = {"base": {"base"}}
    for i, layer in enumerate(COMPILER):
        allowed[layer] = {"base", *COMPILER[: i + 1]}
    shared = {"base", "ir", "cost", "schedule", "reorder", "report", "sim"}
    for i, layer in enumerate(RUNTIME):
        allowed[layer] = shared | set(RUNTIME[: i + 1])
    allowed["resolve"] = {"base", "ir", "frontend", "resolve"} | allowed["data"]
    allowed["driver"] = {"base", "ir", "frontend", "resolve", "driver"}
    # codegen emits the runtime's bundle (its Job, mesh, worker entry points): it sees
    # everything but the CLI.
    allowed["codegen"] = set(allowed) | {"driver"}
    allowed["cli"] = set(allowed) | {"cli"}
    return allowed


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def layer_of(module: str) -> str:
    """The layer of a dtdsl module name; an unknown top-level name fails loudly."""
    if module in CLI_MODULES or module.startswith("dtdsl.cli."):
        return "cli"
    parts = module.split(".")
    if len(parts) == 1:
        return "base"
    top = parts[1]
    if top in BASE:
        return "base"
    if top in COMPILER or top in RUNTIME or top in ("resolve", "driver"):
        return top
    raise AssertionError(
        f"{module} belongs to no layer: add {top!r} to the order in tests/test_layers.py"
    )


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a ``from`` import names, relative levels resolved."""
    if node.level == 0:
        return node.module or ""
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """Every dtdsl module ``module`` imports, at any depth, with its line number."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = resolve(module, path.name == "__init__.py", node)
            # ``from pkg import mod`` imports the submodule pkg.mod when there is one.
            names = [f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target
                     for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules and "." in name:
                name = name.rsplit(".", 1)[0]
            if name.startswith("dtdsl") and name in modules and name != module:
                found.append((name, node.lineno))
    return found


def import_graph() -> dict[str, list[tuple[str, int]]]:
    modules = all_modules()
    return {m: imports_of(m, p, modules) for m, p in modules.items()}


def violations(graph: dict[str, list[tuple[str, int]]]) -> dict[tuple[str, str], str]:
    allowed = allowed_layers()
    found: dict[tuple[str, str], str] = {}
    for importer, targets in graph.items():
        mine = layer_of(importer)
        for target, line in targets:
            theirs = layer_of(target)
            # A package's __init__ (e.g. dtdsl) re-exports nothing from above: same rule.
            if theirs not in allowed[mine]:
                found.setdefault(
                    (importer, target),
                    f"{importer} (layer {mine}) line {line} imports {target} (layer {theirs})",
                )
    return found


def cycles(graph: dict[str, list[tuple[str, int]]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    result: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target, _ in graph.get(node, []):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                result.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return result


def test_every_module_has_a_layer():
    for module in all_modules():
        layer_of(module)


def test_no_import_reaches_up_a_layer():
    found = violations(import_graph())
    new = [why for key, why in sorted(found.items()) if key not in DEBT]
    gone = [f"{a} -> {b}" for (a, b) in sorted(DEBT) if (a, b) not in found]
    assert not new, "imports of a higher layer:\n  " + "\n  ".join(new)
    assert not gone, "DEBT entries that no longer occur (delete them):\n  " + "\n  ".join(gone)


def test_no_import_cycles():
    found = {frozenset(c) for c in cycles(import_graph())}
    new = [" <-> ".join(sorted(c)) for c in found if c not in CYCLE_DEBT]
    gone = [" <-> ".join(sorted(c)) for c in CYCLE_DEBT if c not in found]
    assert not new, "import cycles:\n  " + "\n  ".join(sorted(new))
    assert not gone, "CYCLE_DEBT entries that no longer occur (delete them):\n  " + \
        "\n  ".join(sorted(gone))


@pytest.mark.parametrize(
    "source, expected",
    [
        ("from dtdsl.planner import x\n", "dtdsl.planner"),
        ("def f():\n    from ..planner.space import y\n", "dtdsl.planner.space"),
        ("import dtdsl.sim.run\n", "dtdsl.sim.run"),
    ],
)
def test_scanner_sees_lazy_and_relative_imports(tmp_path, source, expected):
    """The checker itself: a lazy relative import of a higher layer is caught."""
    path = tmp_path / "x.py"
    path.write_text(source, encoding="utf-8")
    modules = all_modules()
    found = imports_of("dtdsl.ir.x", path, modules)
    assert [name for name, _ in found] == [expected]
    graph = {"dtdsl.ir.x": found}
    assert ("dtdsl.ir.x", expected) in violations(graph)


def test_cycle_finder_sees_a_three_module_circle():
    graph = {"a": [("b", 1)], "b": [("c", 1)], "c": [("a", 1)], "d": [("a", 1)]}
    assert cycles(graph) == [["a", "b", "c"]]
