"""The syntax tree of a spec: what was written, where, before any meaning is given.

Every node is frozen and carries the span of source it came from. Names are
kept as written; the checker (``dtdsl.frontend.check``) resolves them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict
from pydantic import Field as PydField

from dtdsl.source import Span

__all__ = [
    "Arg", "Block", "Bool", "Call", "ClusterBlock", "Comment", "Constraint",
    "ConstraintsBlock", "DataBlock", "Distribution", "Expr", "Field", "ListExpr",
    "ModelBlock", "Module", "Name", "Node", "Number", "Projector", "Range", "Ref",
    "SetExpr", "Spec", "String", "TrainBlock", "dump_ast", "strip_spans",
]


class Node(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", kw_only=True)

    span: Span


# ---- expressions -------------------------------------------------------------

class Number(Node):
    """A number literal; ``unit`` is the suffix as written ("GiB", "%", "k") or None."""

    kind: Literal["number"] = "number"
    value: int | float
    unit: str | None = None
    digits: str  # the number as written, without the unit (kept by `dtc fmt`)


class String(Node):
    kind: Literal["string"] = "string"
    value: str


class Bool(Node):
    kind: Literal["bool"] = "bool"
    value: bool


class Name(Node):
    kind: Literal["name"] = "name"
    name: str


class Ref(Node):
    """A dotted reference such as ``gpu.memory``."""

    kind: Literal["ref"] = "ref"
    parts: tuple[str, ...]


class ListExpr(Node):
    kind: Literal["list"] = "list"
    items: tuple[Expr, ...]


class SetExpr(Node):
    kind: Literal["set"] = "set"
    items: tuple[Expr, ...]


class Range(Node):
    """``low..high``, both ends included."""

    kind: Literal["range"] = "range"
    low: Expr
    high: Expr


class Arg(Node):
    """A call argument: ``name = value``, a positional value, or a bare flag (a Name)."""

    name: str | None
    value: Expr


class Call(Node):
    kind: Literal["call"] = "call"
    func: str
    func_span: Span
    args: tuple[Arg, ...]

    def arg_span(self, name: str) -> Span:
        """Where argument ``name`` is written (``name=...`` or a bare ``name``), else the
        call's own span: what a diagnostic about that argument points at."""
        for arg in self.args:
            if arg.name == name or (arg.name is None and isinstance(arg.value, Name)
                                    and arg.value.name == name):
                return arg.span
        return self.span


Expr = Annotated[
    Number | String | Bool | Name | Ref | ListExpr | SetExpr | Range | Call,
    PydField(discriminator="kind"),
]


# ---- statements and declarations --------------------------------------------

class Field(Node):
    """``key = value``."""

    kind: Literal["field"] = "field"
    key: str
    key_span: Span
    value: Expr


class Distribution(Node):
    """``modality.quantity ~ dist(...) [clamp [lo, hi]]`` in a data block."""

    kind: Literal["distribution"] = "distribution"
    modality: str
    quantity: str
    target_span: Span
    dist: Expr
    clamp: tuple[Expr, Expr] | None = None


class Constraint(Node):
    """``axis(target) op value``; target is a module name or ``*``."""

    axis: str
    axis_span: Span
    target: str
    target_span: Span
    op: str
    value: Expr


class Module(Node):
    """``encoder|backbone|generator NAME [(modality)] { fields }``."""

    kind: Literal["module"] = "module"
    role: str
    name: str
    name_span: Span
    modality: str | None = None
    modality_span: Span | None = None
    fields: tuple[Field, ...]


class Projector(Node):
    """``projector SRC -> DST : arch`` (short form) or ``projector SRC -> DST { fields }``.

    The short form is stored as a single ``arch`` field with ``short=True``.
    """

    kind: Literal["projector"] = "projector"
    source: str
    source_span: Span
    target: str
    target_span: Span
    short: bool
    fields: tuple[Field, ...]


class ModelBlock(Node):
    kind: Literal["model"] = "model"
    items: tuple[Annotated[Module | Projector, PydField(discriminator="kind")], ...]


class DataBlock(Node):
    kind: Literal["data"] = "data"
    name: str | None = None
    items: tuple[Annotated[Field | Distribution, PydField(discriminator="kind")], ...]


class ClusterBlock(Node):
    kind: Literal["cluster"] = "cluster"
    name: str | None = None
    fields: tuple[Field, ...]


class TrainBlock(Node):
    kind: Literal["train"] = "train"
    fields: tuple[Field, ...]


class ConstraintsBlock(Node):
    kind: Literal["constraints"] = "constraints"
    constraints: tuple[Constraint, ...]


Block = Annotated[
    ModelBlock | DataBlock | ClusterBlock | TrainBlock | ConstraintsBlock,
    PydField(discriminator="kind"),
]


class Comment(Node):
    """A ``#`` comment, kept so that ``dtc fmt`` can put it back."""

    text: str


class Spec(Node):
    name: str | None = None
    name_span: Span | None = None
    blocks: tuple[Block, ...]
    comments: tuple[Comment, ...] = ()


for _model in (ListExpr, SetExpr, Range, Arg, Call, Field, Distribution, Constraint, Module,
               Projector, ModelBlock, DataBlock, ClusterBlock, TrainBlock, ConstraintsBlock,
               Spec):
    _model.model_rebuild()


# ---- utilities -------------------------------------------------------------

_SPAN_KEYS = frozenset({"span", "func_span", "key_span", "target_span", "axis_span",
                        "name_span", "source_span", "modality_span"})


def strip_spans(node: BaseModel) -> Any:
    """The node as plain data without positions or comments: equal iff same meaning as written."""

    def walk(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()
                    if k not in _SPAN_KEYS and k != "comments"}
        if isinstance(value, (list, tuple)):
            return [walk(v) for v in value]
        return value

    return walk(node.model_dump())


def dump_ast(node: Node) -> str:
    """An indented tree of the nodes with their spans: the text form of ``--emit ast``."""
    lines: list[str] = []

    def scalar(value: Any) -> bool:
        return not isinstance(value, (BaseModel, tuple, list))

    def visit(value: Any, indent: int, label: str) -> None:
        pad = "  " * indent
        if isinstance(value, Node):
            attrs = []
            children = []
            for key in type(value).model_fields:
                if key in _SPAN_KEYS or key == "kind":
                    continue
                item = getattr(value, key)
                if key == "comments" or item is None or item == ():
                    continue
                if scalar(item):
                    attrs.append(f"{key}={item!r}")
                else:
                    children.append((key, item))
            head = f"{pad}{label}{type(value).__name__}"
            lines.append(" ".join([head, *attrs]) + f"  @{value.span.line}:{value.span.column}"
                         f"-{value.span.end_line}:{value.span.end_column}")
            for key, item in children:
                visit(item, indent + 1, f"{key}: ")
        elif isinstance(value, (tuple, list)):
            for i, item in enumerate(value):
                visit(item, indent, f"{label.rstrip(': ')}[{i}]: " if label else "")
        else:
            lines.append(f"{pad}{label}{value!r}")

    visit(node, 0, "")
    return "\n".join(lines) + "\n"
