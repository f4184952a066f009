"""Files that ship with the package: the grammar and the code generation templates.

In the source tree they live at the top level (``grammar/``, ``codegen_templates/``);
the wheel maps them into the package as ``dtdsl/_grammar`` and ``dtdsl/_templates``
(see pyproject.toml), so an installed ``dtc`` finds them from any working directory.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["grammar_text", "templates_dir"]

_PACKAGE = Path(__file__).resolve().parent


def _resource_dir(installed: str, source: str) -> Path:
    # They are data folders, not packages: importlib.resources would see namespace
    # packages there, whose paths do not convert to plain filesystem paths.
    path = _PACKAGE / installed
    if path.is_dir():
        return path
    return _PACKAGE.parent / source  # a source checkout or an editable install


def grammar_text() -> str:
    """The text of ``dtdsl.lark``."""
    return (_resource_dir("_grammar", "grammar") / "dtdsl.lark").read_text("utf-8")


def templates_dir() -> Path:
    """The folder of jinja2 templates used by the code generator."""
    return _resource_dir("_templates", "codegen_templates")
