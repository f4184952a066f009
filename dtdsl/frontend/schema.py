"""Typed parameters of the language: what each field and call argument accepts.

A ``Param`` names a field, its ``Kind`` (integer, size, enum, ...), whether it
is required and its default. ``resolve_fields`` and ``resolve_call`` turn AST
fields and calls into plain values, reporting unknown names (with a "did you
mean"), duplicates, missing values, wrong types, wrong units and values out of
range, all of them, without stopping at the first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dtdsl.codes import DT201, DT202, DT204, DT205, DT206, DT207, DT208
from dtdsl.diagnostics import Diagnostic, did_you_mean
from dtdsl.frontend import ast
from dtdsl.frontend.units import DIMENSIONS, dimension_of
from dtdsl.source import Span

__all__ = [
    "INVALID", "BoolKind", "CallKind", "Ctx", "EnumKind", "FloatKind", "FractionKind", "IntKind",
    "Kind",
    "ListKind", "Param", "QuantityKind", "StrKind", "SwitchKind", "describe_expr", "head_span",
    "resolve_call", "resolve_fields",
]


class _Invalid:
    """The value of something that already has an error reported."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "INVALID"

    def __bool__(self) -> bool:
        return False


INVALID = _Invalid()


class Ctx:
    """Collects the diagnostics of one pass."""

    def __init__(self) -> None:
        self.diagnostics: list[Diagnostic] = []

    def error(self, code: str, message: str, span: Span, *, notes: Sequence[str] = (),
              hint: str | None = None) -> _Invalid:
        self.diagnostics.append(Diagnostic.error(code, message, span, notes=notes, hint=hint))
        return INVALID

    def warning(self, code: str, message: str, span: Span, *, notes: Sequence[str] = (),
                hint: str | None = None) -> None:
        self.diagnostics.append(Diagnostic.warning(code, message, span, notes=notes, hint=hint))


def head_span(span: Span, width: int) -> Span:
    """The first ``width`` characters of a span: a block's keyword, not its whole body."""
    return Span(line=span.line, column=span.column, end_line=span.line,
                end_column=span.column + max(width, 1))


def describe_expr(expr: ast.Node) -> str:
    """How a value is named in messages: 'a string', 'the name bf16', '80 GiB'."""
    if isinstance(expr, ast.Number):
        return f"{expr.digits}{_unit_text(expr.unit)}"
    if isinstance(expr, ast.String):
        return "a string"
    if isinstance(expr, ast.Bool):
        return "true" if expr.value else "false"
    if isinstance(expr, ast.Name):
        return f"the name '{expr.name}'"
    if isinstance(expr, ast.Ref):
        return f"the reference '{'.'.join(expr.parts)}'"
    if isinstance(expr, ast.ListExpr):
        return "a list"
    if isinstance(expr, ast.SetExpr):
        return "a set"
    if isinstance(expr, ast.Range):
        return "a range"
    if isinstance(expr, ast.Call):
        return f"a call to {expr.func}(...)"
    return type(expr).__name__


def _unit_text(unit: str | None) -> str:
    if unit is None:
        return ""
    return unit if unit in ("%", "k", "M") else f" {unit}"


def _format_value(value: float) -> str:
    if float(value).is_integer() and abs(value) < 1e15:
        return f"{int(value):,}"
    return f"{value:g}"


# ---- kinds ---------------------------------------------------------------------

@dataclass(frozen=True)
class Kind:
    """Converts one expression to a value, or reports why it cannot."""

    expects: str = field(default="a value", kw_only=True)

    def convert(self, expr: ast.Node, ctx: Ctx, what: str) -> Any:
        raise NotImplementedError

    def _wrong_type(self, expr: ast.Node, ctx: Ctx, what: str, hint: str | None = None):
        return ctx.error(DT206, f"{what} must be {self.expects}, not {describe_expr(expr)}",
                         expr.span, hint=hint)


def _plain_number(expr: ast.Node, ctx: Ctx, what: str, kind: Kind) -> float | int | _Invalid:
    """A number with no unit or a count suffix (k, M), scaled."""
    if not isinstance(expr, ast.Number):
        return kind._wrong_type(expr, ctx, what)
    if expr.unit is None:
        return expr.value
    dim = dimension_of(expr.unit)
    if dim == "count":
        return expr.value * DIMENSIONS["count"].factors[expr.unit]
    return ctx.error(DT207, f"{what} is {kind.expects}, but {describe_expr(expr)} is "
                     f"{DIMENSIONS[dim].name}", expr.span,
                     hint=f"write it as a plain number: {expr.digits}")


def _check_range(value: float, expr: ast.Node, ctx: Ctx, what: str, low: float | None,
                 high: float | None, low_exclusive: bool = False, unit: str = "") -> Any:
    too_low = low is not None and (value <= low if low_exclusive else value < low)
    too_high = high is not None and value > high
    if too_low or too_high:
        if low is not None and high is not None:
            bound = f"between {_format_value(low)} and {_format_value(high)}{unit}"
            if low_exclusive:
                bound = f"above {_format_value(low)} and at most {_format_value(high)}{unit}"
        elif low is not None:
            bound = (f"above {_format_value(low)}" if low_exclusive
                     else f"at least {_format_value(low)}") + unit
        else:
            bound = f"at most {_format_value(high)}{unit}"
        return ctx.error(DT208, f"{what} must be {bound}, not {_format_value(value)}{unit}",
                         expr.span)
    return value


@dataclass(frozen=True)
class IntKind(Kind):
    low: int | None = None
    high: int | None = None
    expects: str = field(default="an integer", kw_only=True)

    def convert(self, expr, ctx, what):
        value = _plain_number(expr, ctx, what, self)
        if value is INVALID:
            return value
        if isinstance(value, float):
            if not value.is_integer():
                return ctx.error(DT206, f"{what} must be a whole number, not "
                                 f"{describe_expr(expr)}", expr.span)
            value = int(value)
        return _check_range(value, expr, ctx, what, self.low, self.high)


@dataclass(frozen=True)
class FloatKind(Kind):
    low: float | None = None
    high: float | None = None
    low_exclusive: bool = False
    expects: str = field(default="a number", kw_only=True)

    def convert(self, expr, ctx, what):
        value = _plain_number(expr, ctx, what, self)
        if value is INVALID:
            return value
        return _check_range(float(value), expr, ctx, what, self.low, self.high,
                            self.low_exclusive)


@dataclass(frozen=True)
class QuantityKind(Kind):
    """A measured value with a unit of one dimension, converted to base units."""

    dim: str = "size"
    low: float | None = None
    high: float | None = None
    expects: str = field(default="", kw_only=True)

    def convert(self, expr, ctx, what):
        dim = DIMENSIONS[self.dim]
        if not isinstance(expr, ast.Number):
            return ctx.error(DT206, f"{what} must be {dim.name} such as {dim.example}, not "
                             f"{describe_expr(expr)}", expr.span)
        if expr.unit is None or expr.unit not in dim.factors:
            got = "a plain number" if expr.unit is None else \
                DIMENSIONS[dimension_of(expr.unit)].name
            return ctx.error(DT207, f"{what} must be {dim.name} such as {dim.example}, but "
                             f"{describe_expr(expr)} is {got}", expr.span,
                             hint=f"units for {dim.name}: " + ", ".join(dim.factors))
        value = expr.value * dim.factors[expr.unit]
        if self.low is not None and value <= self.low or \
                self.high is not None and value > self.high:
            return ctx.error(DT208, f"{what} of {describe_expr(expr)} is not believable",
                             expr.span, notes=[f"expected {dim.name} above "
                                               f"{_format_value(self.low or 0)} and at most "
                                               f"{_format_value(self.high)} in base units"])
        return value


@dataclass(frozen=True)
class FractionKind(Kind):
    """A percentage (90%) or a fraction (0.9), in (0, 1]."""

    expects: str = field(default="a percentage such as 90%", kw_only=True)

    def convert(self, expr, ctx, what):
        if not isinstance(expr, ast.Number):
            return self._wrong_type(expr, ctx, what)
        if expr.unit == "%":
            value = expr.value / 100
        elif expr.unit is None:
            value = expr.value
        else:
            return ctx.error(DT207, f"{what} must be {self.expects}, not "
                             f"{describe_expr(expr)}", expr.span)
        if not 0 < value <= 1:
            return ctx.error(DT208, f"{what} must be above 0% and at most 100%, not "
                             f"{describe_expr(expr)}", expr.span)
        return float(value)


@dataclass(frozen=True)
class BoolKind(Kind):
    expects: str = field(default="true or false", kw_only=True)

    def convert(self, expr, ctx, what):
        if isinstance(expr, ast.Bool):
            return expr.value
        return self._wrong_type(expr, ctx, what)


@dataclass(frozen=True)
class StrKind(Kind):
    expects: str = field(default='a string in double quotes', kw_only=True)
    max_len: int = 4096

    def convert(self, expr, ctx, what):
        if isinstance(expr, ast.String):
            if len(expr.value) > self.max_len:
                return ctx.error(DT208, f"{what} is {len(expr.value):,} characters long; "
                                 f"the limit is {self.max_len:,}", expr.span)
            return expr.value
        hint = None
        if isinstance(expr, ast.Name):
            hint = f'quote it: "{expr.name}"'
        return self._wrong_type(expr, ctx, what, hint=hint)


@dataclass(frozen=True)
class EnumKind(Kind):
    choices: tuple[str, ...] = ()
    expects: str = field(default="one of a fixed set of names", kw_only=True)

    def convert(self, expr, ctx, what):
        listed = ", ".join(self.choices)
        if isinstance(expr, ast.String):
            expr = ast.Name(name=expr.value, span=expr.span)
        if not isinstance(expr, ast.Name):
            return ctx.error(DT206, f"{what} must be one of {listed}, not "
                             f"{describe_expr(expr)}", expr.span)
        if expr.name in self.choices:
            return expr.name
        guess = did_you_mean(expr.name, self.choices)
        return ctx.error(DT205, f"unknown {what} '{expr.name}'", expr.span,
                         notes=[f"{what} is one of: {listed}"],
                         hint=f"did you mean '{guess}'?" if guess else None)


@dataclass(frozen=True)
class SwitchKind(EnumKind):
    """One of ``choices`` or ``true`` / ``false`` (a field that was a switch and grew
    modes: ``recompute``); a bool is returned as it is, for the IR to read."""

    def convert(self, expr, ctx, what):
        if isinstance(expr, ast.Bool):
            return expr.value
        return super().convert(expr, ctx, what)


@dataclass(frozen=True)
class ListKind(Kind):
    item: Kind = field(default_factory=lambda: IntKind(low=1))
    min_len: int = 1
    max_len: int = 64
    expects: str = field(default="a list such as [1, 2, 4]", kw_only=True)

    def convert(self, expr, ctx, what):
        if not isinstance(expr, ast.ListExpr):
            return self._wrong_type(expr, ctx, what)
        if not self.min_len <= len(expr.items) <= self.max_len:
            return ctx.error(DT208, f"{what} must have between {self.min_len} and "
                             f"{self.max_len} items, not {len(expr.items)}", expr.span)
        values = [self.item.convert(item, ctx, f"each item of {what}") for item in expr.items]
        return INVALID if any(v is INVALID for v in values) else tuple(values)


@dataclass(frozen=True)
class CallKind(Kind):
    """A call such as ``transformer(...)``; with ``allow_bare``, a bare name means a call
    without arguments (``schedule = 1f1b``, ``gpu = H800``)."""

    allow_bare: bool = False
    expects: str = field(default="a call such as name(...)", kw_only=True)

    def convert(self, expr, ctx, what):
        if isinstance(expr, ast.Call):
            return expr
        if self.allow_bare and isinstance(expr, ast.Name):
            return ast.Call(func=expr.name, func_span=expr.span, args=(), span=expr.span)
        return self._wrong_type(expr, ctx, what)


# ---- parameters and their resolution ------------------------------------------------

@dataclass(frozen=True)
class Param:
    name: str
    kind: Kind
    required: bool = False
    default: Any = None
    doc: str = ""


def _lookup(name: str, span: Span, params: dict[str, Param], ctx: Ctx, where: str,
            noun: str, suggested: set[str]) -> Param | None:
    if name in params:
        return params[name]
    guess = did_you_mean(name, params)
    if guess:
        suggested.add(guess)
    ctx.error(DT201, f"unknown {noun} '{name}' in {where}", span,
              notes=[f"{where} takes: " + ", ".join(params)],
              hint=f"did you mean '{guess}'?" if guess else None)
    return None


def _fill_defaults(values: dict[str, Any], params: dict[str, Param], ctx: Ctx, where: str,
                   span: Span, noun: str, suggested: set[str]) -> dict[str, Any]:
    for p in params.values():
        if p.name in values:
            continue
        if p.required and p.name in suggested:
            values[p.name] = INVALID  # "did you mean" already pointed at it
        elif p.required:
            values[p.name] = ctx.error(DT204, f"{where} needs the {noun} '{p.name}'", span,
                                       hint=p.doc or None)
        else:
            values[p.name] = p.default
    return values


def resolve_fields(fields: Sequence[ast.Field], params: Sequence[Param], ctx: Ctx, where: str,
                   span: Span) -> dict[str, Any]:
    """``key = value`` fields of a block, checked against ``params``; defaults filled in.

    Missing required fields are reported at ``span`` (the block's header).
    """
    table = {p.name: p for p in params}
    values: dict[str, Any] = {}
    first: dict[str, ast.Field] = {}
    suggested: set[str] = set()
    for f in fields:
        if f.key in first:
            ctx.error(DT202, f"'{f.key}' is set twice in {where}", f.key_span,
                      notes=[f"first set at line {first[f.key].span.line}"],
                      hint="remove one of them")
            continue
        first[f.key] = f
        param = _lookup(f.key, f.key_span, table, ctx, where, "field", suggested)
        if param is not None:
            values[f.key] = param.kind.convert(f.value, ctx, f"{where}.{f.key}")
    return _fill_defaults(values, table, ctx, where, span, "field", suggested)


def resolve_call(call: ast.Call, params: Sequence[Param], ctx: Ctx, where: str,
                 positional: int = 0) -> dict[str, Any]:
    """The arguments of ``call`` against ``params``; the first ``positional`` may be given
    by position, and a boolean parameter by its bare name (``swiglu``)."""
    table = {p.name: p for p in params}
    order = list(table)[:positional]
    values: dict[str, Any] = {}
    seen: dict[str, Span] = {}
    suggested: set[str] = set()
    position = 0
    for arg in call.args:
        name = arg.name
        value = arg.value
        if name is None and isinstance(value, ast.Name) and value.name in table \
                and isinstance(table[value.name].kind, BoolKind):
            name, value = value.name, ast.Bool(value=True, span=value.span)
        if name is None:
            if position >= len(order):
                ctx.error(DT206, f"{where} takes {'no' if not order else len(order)} "
                          f"positional argument{'s' if len(order) != 1 else ''}; name this "
                          "one", arg.span, notes=[f"{where} takes: " + ", ".join(table)],
                          hint=f"write it as {list(table)[0]}=..." if table else None)
                continue
            name = order[position]
            position += 1
        if name in seen:
            ctx.error(DT202, f"'{name}' is given twice in {where}", arg.span,
                      notes=[f"first given at {seen[name]}"])
            continue
        seen[name] = arg.span
        param = _lookup(name, arg.span if arg.name is None else
                        Span(line=arg.span.line, column=arg.span.column,
                             end_line=arg.span.line, end_column=arg.span.column + len(name)),
                        table, ctx, where, "argument", suggested)
        if param is not None:
            values[name] = param.kind.convert(value, ctx, f"{name} in {where}")
    return _fill_defaults(values, table, ctx, where, call.span, "argument", suggested)


def is_finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value)
