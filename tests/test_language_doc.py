"""docs/language.md documents the language as the code implements it.

Every field, argument, distribution, GPU preset, keyword and unit the code knows is named in
the manual; each field table (marked ``<!-- params: TABLE -->``) lists exactly the
parameters of the checker's table of that name, with the same required fields, defaults
and ranges; and every ```dt example is a complete spec that checks without a single
diagnostic and is already in ``dtc fmt``'s layout.
"""

from __future__ import annotations

import math
import re
import typing
from pathlib import Path

import pytest

from dtdsl.codes import CODES
from dtdsl.driver import run_frontend
from dtdsl.frontend import tables
from dtdsl.frontend.constraints import AXES, DEFAULT_MEMORY_FRACTION, DEFAULT_TP
from dtdsl.frontend.fmt import format_spec
from dtdsl.frontend.parser import UNITS
from dtdsl.frontend.schema import (
    BoolKind,
    CallKind,
    EnumKind,
    FloatKind,
    IntKind,
    Kind,
    ListKind,
    Param,
    QuantityKind,
    StrKind,
)
from dtdsl.frontend.units import DIMENSIONS
from dtdsl.ir.hardware import GPU_PRESETS
from dtdsl.ir.program import MODALITIES, QUANTITIES, ROLES, SCHEDULES, Optimizer
from dtdsl.resources import grammar_text

ROOT = Path(__file__).resolve().parent.parent
DOC_PATH = ROOT / "docs" / "language.md"
DOC = DOC_PATH.read_text("utf-8")

_CODE_SPAN = re.compile(r"`([^`\n]+)`")
_DT_BLOCK = re.compile(r"^```dt\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
_FILE_BLOCK = re.compile(r"^<!-- file: (\S+) -->\n```[\w-]*\n(.*?)^```[ \t]*$",
                         re.MULTILINE | re.DOTALL)
_TABLE_MARK = re.compile(r"^<!-- params: (\w+) -->\n((?:\|.*\n?)+)", re.MULTILINE)


def _spans(text: str) -> set[str]:
    """The code spans of a text, with digit-grouping underscores removed (`1_024` -> 1024)."""
    return {re.sub(r"(?<=\d)_(?=\d)", "", s).strip() for s in _CODE_SPAN.findall(text)}


DOC_SPANS = _spans(DOC)


# ---- what the code knows --------------------------------------------------------------

def _param_tables() -> dict[str, tuple[Param, ...]]:
    """Every module-level tuple of Params in the checker's tables (MODULE_FIELDS, ...)."""
    return {name: value for name, value in vars(tables).items()
            if isinstance(value, tuple) and value and all(isinstance(p, Param) for p in value)}


def _dict_tables() -> dict[str, tuple[tuple[str, ...], tuple[Param, ...]]]:
    """Every module-level dict of the checker whose values are Param tables (ARCHS,
    DISTRIBUTIONS, the schedules), as (its keys, all its Params)."""
    out = {}
    for name, value in vars(tables).items():
        if not isinstance(value, dict) or not value:
            continue
        params: list[Param] = []
        for entry in value.values():
            if isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[1], int):
                entry = entry[0]  # DISTRIBUTIONS: (parameters, how many by position)
            if not isinstance(entry, tuple) or not all(isinstance(p, Param) for p in entry):
                break
            params.extend(entry)
        else:
            out[name] = (tuple(value), tuple(params))
    return out


def _kind_names(kind: Kind) -> list[str]:
    """The fixed names a kind accepts (the choices of an enum, also inside a list)."""
    if isinstance(kind, EnumKind):
        return list(kind.choices)
    if isinstance(kind, ListKind):
        return _kind_names(kind.item)
    return []


def _names() -> dict[str, list[str]]:
    params = [p for table in _param_tables().values() for p in table]
    dicts = _dict_tables()
    params += [p for _, table in dicts.values() for p in table]
    optimizers = typing.get_args(Optimizer.model_fields["name"].annotation)
    return {
        "fields and arguments": sorted({p.name for p in params}),
        "choices": sorted({c for p in params for c in _kind_names(p.kind)}),
        "architectures, distributions and schedules": sorted(
            {k for keys, _ in dicts.values() for k in keys}),
        "distributions": list(tables.DISTRIBUTIONS),
        "GPU presets": list(GPU_PRESETS),
        "roles": list(ROLES),
        "modalities": list(MODALITIES),
        "quantities": [f"{m}.{q}" for m, qs in QUANTITIES.items() for q in qs],
        "schedules": list(SCHEDULES),
        "optimizers": list(optimizers),
        "constraint axes": list(AXES),
        "keywords": sorted(set(re.findall(r'"([a-z]+)"', grammar_text()))),
        "units": sorted(set(UNITS) | {u for d in DIMENSIONS.values() for u in d.factors}),
    }


def test_the_tables_are_found():
    assert {"MODULE_FIELDS", "TRANSFORMER_ARGS", "UNET_ARGS", "DIT_ARGS", "MLP_ARGS",
            "DATA_FIELDS", "CLUSTER_FIELDS", "TRAIN_FIELDS"} <= set(_param_tables())
    assert {"ARCHS", "DISTRIBUTIONS"} <= set(_dict_tables())


@pytest.mark.parametrize("what", list(_names()))
def test_every_name_is_documented(what):
    missing = [name for name in _names()[what] if name not in DOC_SPANS]
    assert not missing, f"{what} not in docs/language.md as `name`: {missing}"


# ---- the field tables ------------------------------------------------------------------

def _doc_tables() -> dict[str, list[list[str]]]:
    """Each marked table of the manual: its body rows, as lists of cells."""
    tables = {}
    for name, text in _TABLE_MARK.findall(DOC):
        rows = [[c.strip() for c in line.strip().strip("|").split("|")]
                for line in text.strip().splitlines()]
        assert len(rows) > 2 and set(rows[1][0]) <= {"-", ":"}, f"table {name} is malformed"
        assert name not in tables, f"two tables marked {name}"
        tables[name] = rows[2:]
    return tables


def _literal(text: str):
    """A default as the manual writes it, in the spec syntax: `false`, `[4, 2, 1]`, `1e-4`."""
    text = text.strip()
    if text in ("true", "false"):
        return text == "true"
    if text.startswith("[") and text.endswith("]"):
        inner = text[1:-1].strip()
        return tuple(_literal(item) for item in inner.split(",")) if inner else ()
    if len(text) >= 2 and text[0] == text[-1] == '"':
        return text[1:-1]
    plain = re.sub(r"(?<=\d)_(?=\d)", "", text)
    for convert in (int, float):
        try:
            return convert(plain)
        except ValueError:
            pass
    return text


def _same(doc, code) -> bool:
    if isinstance(doc, bool) or isinstance(code, bool):
        return isinstance(doc, bool) and isinstance(code, bool) and doc == code
    if isinstance(doc, tuple) and isinstance(code, tuple):
        return len(doc) == len(code) and all(map(_same, doc, code))
    if isinstance(doc, (int, float)) and isinstance(code, (int, float)):
        return math.isclose(doc, code)
    return doc == code


def _number(x: float) -> str:
    if isinstance(x, int):
        return str(x)
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def _range_text(kind: IntKind | FloatKind) -> str | None:
    """How the manual writes a range: `1..1024`, `> 0, <= 10`, `>= 0`."""
    low, high = kind.low, kind.high
    exclusive = getattr(kind, "low_exclusive", False)
    if low is not None and high is not None:
        return f"> {_number(low)}, <= {_number(high)}" if exclusive \
            else f"{_number(low)}..{_number(high)}"
    if low is not None:
        return f"{'>' if exclusive else '>='} {_number(low)}"
    if high is not None:
        return f"<= {_number(high)}"
    return None


def _kind_problems(kind: Kind, cell: str) -> list[str]:
    spans = _spans(cell)
    if isinstance(kind, ListKind):
        return ([] if "list" in cell else ["does not say 'list'"]) + \
            _kind_problems(kind.item, cell)
    words = {IntKind: "integer", FloatKind: "number", BoolKind: "bool", StrKind: "string",
             CallKind: "call"}
    problems = []
    for cls, word in words.items():
        if type(kind) is cls and word not in cell:
            problems.append(f"does not say '{word}'")
    if isinstance(kind, (IntKind, FloatKind)):
        expected = _range_text(kind)
        if expected is not None and expected not in spans:
            problems.append(f"does not give the range `{expected}`")
    if isinstance(kind, QuantityKind):
        dimension = DIMENSIONS[kind.dim].name.removeprefix("a ")
        if dimension not in cell:
            problems.append(f"does not say '{dimension}'")
    problems += [f"does not name `{c}`" for c in _kind_names(kind) if c not in spans]
    return problems


def test_every_table_of_the_checker_has_a_table_in_the_manual():
    assert sorted(_doc_tables()) == sorted(_param_tables())


@pytest.mark.parametrize("table", sorted(_param_tables()))
def test_field_table_matches_the_code(table):
    params = {p.name: p for p in _param_tables()[table]}
    rows = _doc_tables().get(table)
    assert rows is not None, f"docs/language.md has no table marked <!-- params: {table} -->"
    documented = {}
    for row in rows:
        assert len(row) == 4, f"{table}: a row needs name | type | default | meaning: {row}"
        names = _CODE_SPAN.findall(row[0])
        assert len(names) == 1, f"{table}: the first cell names one field: {row[0]}"
        documented[names[0]] = row
    missing = [name for name in params if name not in documented]
    unknown = [name for name in documented if name not in params]
    assert not missing and not unknown, \
        f"{table}: no row for {missing}; rows for names the code does not have: {unknown}"
    assert list(documented) == list(params), f"{table}: the rows are not in the code's order"
    problems = []
    for name, param in params.items():
        _, kind_cell, default_cell, meaning = documented[name]
        assert meaning, f"{table}.{name} has no meaning"
        problems += [f"{name}: type {p}" for p in _kind_problems(param.kind, kind_cell)]
        if param.required != default_cell.startswith("**required**"):
            problems.append(f"{name}: required is {param.required}, the manual says "
                            f"{default_cell!r}")
        if param.default is not None:
            shown = _CODE_SPAN.findall(default_cell)
            if not shown or not _same(_literal(shown[0]), param.default):
                problems.append(f"{name}: default is {param.default!r}, the manual says "
                                f"{default_cell!r}")
    assert not problems, f"{table}: " + "; ".join(problems)


def test_gpu_presets_table_matches_the_code():
    for name, preset in GPU_PRESETS.items():
        row = re.search(rf"^\| `{name}` \|(.*)\|$", DOC, re.MULTILINE)
        assert row, f"no row for GPU preset {name}"
        cells = [c.strip() for c in row.group(1).split("|")]
        assert cells == [f"{preset.memory_bytes / 1e9:g} GB",
                         f"{preset.peak_flops / 1e12:g} TFLOPS",
                         f"{preset.intra_node_bw_bytes_per_s / 1e9:g} GB/s",
                         f"{preset.inter_node_bw_bytes_per_s * 8 / 1e9:g} Gb/s"], name


def test_constraint_defaults_are_documented():
    assert "{" + ", ".join(map(str, DEFAULT_TP)) + "}" in DOC_SPANS
    assert f"{DEFAULT_MEMORY_FRACTION:.0%}" in DOC_SPANS


def test_every_code_the_manual_names_exists():
    unknown = sorted(set(re.findall(r"\bDT\d{3}\b", DOC)) - set(CODES))
    assert not unknown, f"docs/language.md names codes that do not exist: {unknown}"


# ---- the examples ----------------------------------------------------------------------

def _examples() -> list[tuple[int, str]]:
    return [(DOC.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in _DT_BLOCK.finditer(DOC)]


def test_the_manual_has_examples():
    assert len(_examples()) >= 5


@pytest.mark.parametrize("line, text", _examples(), ids=[f"line{n}" for n, _ in _examples()])
def test_example_checks_cleanly_and_is_formatted(line, text, tmp_path):
    for name, content in _FILE_BLOCK.findall(DOC):  # files the examples read
        (tmp_path / name).write_text(content, "utf-8")
    result = run_frontend(f"docs/language.md:{line}", text.encode(), base_dir=tmp_path)
    shown = [f"{d.span.line + line - 1}: {d.code} {d.message}" for d in result.diagnostics]
    assert result.program is not None and not shown, shown
    assert format_spec(result.spec) == text, "not in `dtc fmt` layout"
