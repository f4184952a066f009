"""Files that ship with the package: the grammar and the code generation templates.

In the source tree they live at the top level (``grammar/``, ``codegen_templates/``);
the wheel maps them into the package as ``dtdsl._grammar`` and
``dtdsl._templates`` (see pyproject.toml), so an installed ``dtc`` finds them
from any working directory.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

__all__ = ["grammar_text", "templates_dir"]

_SOURCE_ROOT = Path(__file__).resolve().parent.parent


def _package_dir(package: str, source_dir: str) -> Path:
    try:
        return Path(str(resources.files(package)))
    except ModuleNotFoundError:
        # Running from a source checkout that was never installed.
        return _SOURCE_ROOT / source_dir


def grammar_text() -> str:
    """The text of ``dtdsl.lark``."""
    return (_package_dir("dtdsl._grammar", "grammar") / "dtdsl.lark").read_text("utf-8")


def templates_dir() -> Path:
    """The folder of jinja2 templates used by the code generator."""
    return _package_dir("dtdsl._templates", "codegen_templates")
