"""Every dotted name the docs cite in backticks names something that exists.

A name whose first part is a dtdsl package or module (``train.stage.build_stage``,
``dtdsl.feed.wire``) or a public top-level name of one (``Stage.reduce_gradients``)
must resolve by imports and attributes, or be a field path of the checked ``Program``
(``train.grad_clip``: the spec's blocks). Other names (``torch.compile``, file names
such as ``job.json``) are not dtdsl's and are skipped.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
import typing
from pathlib import Path
from typing import Any

import pytest

import dtdsl
from dtdsl.ir.program import Program

__all__: list[str] = []

_DOCS = Path(__file__).resolve().parents[1] / "docs"
_NAME = re.compile(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(\))?`")
# File names the docs cite: not Python names.
_FILE = re.compile(r"\.(py|sh|json|md|dt|lark|npy|tar|mp4|txt|toml|sbatch|key|index|"
                   r"safetensors|metadata|yaml|jsonl|flac|wav|mp3|ogg|jpg|png)$")

# First parts that are also the spec's, a JSON file's or the standard library's words:
# data quantities (``text.tokens``, ``audio.frames``), job.json's and a profile's
# fields (``job.cost``, ``device.dtype``), spec blocks (``checkpoint.keep``, placement
# ``simulated.packing``), Hub weight names (``mlp.experts.N``), ``ast.literal_eval``.
_VOCABULARY = {"text", "image", "audio", "video", "job", "device", "checkpoint",
               "simulated", "mlp", "ast"}


def _modules() -> dict[str, list[Any]]:
    """Every dtdsl module by each dotted tail of its name (``dtdsl.parallel.tp``,
    ``parallel.tp``, ``tp``): the docs cite modules as the code imports them. ``ir`` is
    also ``ir.program``, which the code imports as ``ir``."""
    found: dict[str, list[Any]] = {"dtdsl": [dtdsl]}
    for info in pkgutil.walk_packages(dtdsl.__path__, "dtdsl."):
        module = importlib.import_module(info.name)
        parts = info.name.split(".")
        for i in range(len(parts)):
            found.setdefault(".".join(parts[i:]), []).append(module)
    found["ir"].append(importlib.import_module("dtdsl.ir.program"))
    return found


def _members(obj: Any) -> list[Any]:
    """What ``obj`` stands for: the members of a union type alias, else itself."""
    args = typing.get_args(obj)
    return [a for a in args if a is not type(None)] if args else [obj]


def _instance_attrs(cls: type) -> set[str]:
    """Attributes a class's instances get: annotations (dataclass and pydantic fields)
    and ``self.name =`` assignments in its source."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] != "dtdsl":
            continue
        names |= set(getattr(klass, "__annotations__", {}))
        try:
            names |= set(re.findall(r"self\.(\w+)\s*(?::[^=\n]*)?=", inspect.getsource(klass)))
        except (OSError, TypeError):
            pass
    return names


def _attr(objs: list[Any], parts: list[str]) -> bool:
    for part in parts:
        found = []
        for obj in (m for o in objs for m in _members(o)):
            fields = getattr(obj, "model_fields", None)
            if hasattr(obj, part):
                found.append(getattr(obj, part))
            elif isinstance(fields, dict) and part in fields:
                found.append(fields[part].annotation)
            elif isinstance(obj, type) and part in _instance_attrs(obj):
                found.append(typing.get_type_hints(obj).get(part, object)
                             if part in getattr(obj, "__annotations__", {}) else object)
        if not found:
            return False
        objs = found
    return bool(objs)


def _resolves(name: str, modules: dict[str, list[Any]], tops: dict[str, list[Any]]) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if _attr(modules.get(".".join(parts[:i]), []), parts[i:]):
            return True
    if _attr(tops.get(parts[0], []), parts[1:]):
        return True
    # A field path of the program (the spec's blocks: ``train.grad_clip``).
    return _attr([Program], parts)


def _ours(value: Any) -> bool:
    """Whether a module-level value is dtdsl's: a class or function defined in dtdsl, or
    a type alias over dtdsl's classes (``ir.program.Arch``)."""
    return any(getattr(m, "__module__", "").split(".")[0] == "dtdsl"
               and (inspect.isclass(m) or inspect.isfunction(m)) for m in _members(value))


def _tops(modules: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """The public top-level names dtdsl defines (classes, functions, type aliases)."""
    tops: dict[str, list[Any]] = {}
    for module in {id(m): m for ms in modules.values() for m in ms}.values():
        for attr, value in vars(module).items():
            if not attr.startswith("_") and _ours(value):
                tops.setdefault(attr, []).append(value)
    return tops


def _dtdsl_names() -> list[tuple[str, str]]:
    modules = _modules()
    tops = _tops(modules)
    firsts = ({k.split(".")[0] for k in modules} | set(tops)) - _VOCABULARY
    cited = []
    for page in sorted(_DOCS.glob("*.md")):
        for name in sorted(set(_NAME.findall(page.read_text()))):
            if _FILE.search(name) or name.split(".")[0] not in firsts:
                continue
            if not _resolves(name, modules, tops):
                cited.append((page.name, name))
    return cited


def test_every_cited_dtdsl_name_exists():
    missing = _dtdsl_names()
    assert not missing, "docs cite dtdsl names that do not exist: " + ", ".join(
        f"{page}: `{name}`" for page, name in missing)


@pytest.mark.parametrize("name", ["train.stage.build_stage", "Stage.reduce_gradients",
                                  "train.grad_clip", "parallel.p2p.P2P"])
def test_real_names_resolve(name):
    modules = _modules()
    assert _resolves(name, modules, _tops(modules))


@pytest.mark.parametrize("name", ["broker.EAGER_BYTES", "tp.shard_unit", "train.nothing"])
def test_missing_names_do_not_resolve(name):
    modules = _modules()
    assert not _resolves(name, modules, _tops(modules))


_PATH = re.compile(r"`((?:dtdsl|tests|benchmarks|specs|grammar|codegen_templates|docs)/"
                   r"[\w./-]*\w)(?:::\w+)?`")


def test_every_cited_repository_path_exists():
    root = _DOCS.parent
    pages = sorted(_DOCS.glob("*.md")) + [root / "README.md"]
    missing = [f"{page.name}: `{path}`" for page in pages
               for path in sorted(set(_PATH.findall(page.read_text())))
               if not (root / path).exists()]
    assert not missing, "docs cite paths that do not exist: " + ", ".join(missing)
