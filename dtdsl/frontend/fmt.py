"""``dtc fmt``: print a spec's AST in the canonical layout, keeping its comments.

The layout: two-space indentation; one statement per line; one blank line
between top-level blocks; at most one blank line kept between statements;
``=``, ``~`` and constraint operators aligned across a run of adjacent
statements; calls wider than the line limit wrapped under their open
parenthesis. Comments stay where they were: own-line comments before the
statement that follows them, end-of-line comments at the end of their
statement's last line (a comment inside a multi-line statement moves above it);
trailing whitespace is dropped from every line, comments included. The output depends
only on the AST and the comments, so formatting is idempotent.
"""

from __future__ import annotations

from collections.abc import Sequence

from dtdsl.frontend import ast

__all__ = ["LINE_WIDTH", "expr_text", "format_spec"]

LINE_WIDTH = 100
# The widest line whose end-of-line comment is lined up with its run's (``_Printer.items``).
ALIGN_MAX = LINE_WIDTH
_INDENT = "  "
_TIGHT_UNITS = ("%", "k", "M")


def expr_text(expr: ast.Node) -> str:
    """One expression on one line."""
    if isinstance(expr, ast.Number):
        if expr.unit is None:
            return expr.digits
        return expr.digits + (expr.unit if expr.unit in _TIGHT_UNITS else " " + expr.unit)
    if isinstance(expr, ast.String):
        escaped = (expr.value.replace("\\", "\\\\").replace('"', '\\"')
                   .replace("\n", "\\n").replace("\t", "\\t"))
        return f'"{escaped}"'
    if isinstance(expr, ast.Bool):
        return "true" if expr.value else "false"
    if isinstance(expr, ast.Name):
        return expr.name
    if isinstance(expr, ast.Ref):
        return ".".join(expr.parts)
    if isinstance(expr, ast.ListExpr):
        return "[" + ", ".join(expr_text(i) for i in expr.items) + "]"
    if isinstance(expr, ast.SetExpr):
        return "{" + ", ".join(expr_text(i) for i in expr.items) + "}"
    if isinstance(expr, ast.Range):
        return f"{expr_text(expr.low)}..{expr_text(expr.high)}"
    if isinstance(expr, ast.Call):
        return f"{expr.func}(" + ", ".join(_arg_text(a) for a in expr.args) + ")"
    raise AssertionError(f"not an expression: {type(expr).__name__}")


def _arg_text(arg: ast.Arg) -> str:
    value = expr_text(arg.value)
    return value if arg.name is None else f"{arg.name}={value}"


def _value_lines(prefix: str, expr: ast.Node) -> list[str]:
    """``prefix + expr``, wrapping a long call's arguments under its open parenthesis."""
    flat = prefix + expr_text(expr)
    if len(flat) <= LINE_WIDTH or not isinstance(expr, ast.Call) or len(expr.args) < 2:
        return [flat]
    head = f"{prefix}{expr.func}("
    pad = " " * len(head)
    args = [_arg_text(a) for a in expr.args]
    lines: list[str] = []
    current = head
    for i, arg in enumerate(args):
        piece = arg + ("," if i < len(args) - 1 else ")")
        fresh = current in (head, pad)
        if not fresh and len(current) + 1 + len(piece) > LINE_WIDTH:
            lines.append(current)
            current = pad
            fresh = True
        current += piece if fresh else " " + piece
    lines.append(current)
    return lines


def _is_block(item: ast.Node) -> bool:
    return isinstance(item, (ast.ModelBlock, ast.DataBlock, ast.ClusterBlock, ast.TrainBlock,
                             ast.ConstraintsBlock, ast.Module)) or \
        (isinstance(item, ast.Projector) and not item.short)


def _owners(spec: ast.Spec) -> dict[int, object]:
    """Which statement (or closing brace, or the spec header) each end-of-line comment
    belongs to: the last one that ends before it on its line, if nothing starts in between.
    Comments not in the result stand on their own line or inside a statement."""
    enders: dict[int, list[tuple[int, object]]] = {}   # line -> (end column, owner key)
    starters: dict[int, list[int]] = {}                # line -> start columns

    def visit(node: ast.Node) -> None:
        starters.setdefault(node.span.line, []).append(node.span.column)
        if _is_block(node):
            enders.setdefault(node.span.end_line, []).append((node.span.end_column,
                                                              ("close", id(node))))
            for child in _header(node)[1]:
                visit(child)
        else:
            enders.setdefault(node.span.end_line, []).append((node.span.end_column, id(node)))

    if spec.name_span is not None:
        enders.setdefault(spec.name_span.line, []).append((spec.name_span.end_column, "spec"))
    for block in spec.blocks:
        visit(block)
    owners = {}
    for i, comment in enumerate(spec.comments):
        line, column = comment.span.line, comment.span.column
        before = [e for e in enders.get(line, ()) if e[0] <= column]
        if not before:
            continue
        end_column, key = max(before, key=lambda e: e[0])
        if not any(end_column <= c < column for c in starters.get(line, ())):
            owners[i] = key
    return owners


class _Printer:
    def __init__(self, spec: ast.Spec) -> None:
        owners = _owners(spec)
        # Comments that end a line of code, by owner; the others wait for their place.
        self.owned = {key: spec.comments[i] for i, key in owners.items()}
        self.pending = [c for i, c in enumerate(spec.comments) if i not in owners]
        self.next_comment = 0
        self.out: list[str] = []
        self.last_line = 0          # source line where the last emitted item ended
        self.block_start = True     # nothing emitted since the last '{' (or the file start)

    # -- comments and blank lines
    def _gap(self, line: int) -> None:
        """Keep one blank line where the source had any, except right after a '{'."""
        if not self.block_start and self.out and self.out[-1] != "" and \
                line > self.last_line + 1:
            self.out.append("")

    def _emit(self, lines: Sequence[str], end_line: int) -> None:
        self.out.extend(lines)
        self.last_line = end_line
        self.block_start = False

    def _peek(self) -> ast.Comment | None:
        return self.pending[self.next_comment] if self.next_comment < len(self.pending) \
            else None

    def leading(self, before_line: int, depth: int, separate: bool = False) -> bool:
        """Emit the waiting comments that come before ``before_line``; True if any were.

        With ``separate`` (top-level blocks) the first comment is set off by a blank line.
        """
        emitted = False
        while (comment := self._peek()) is not None and comment.span.line < before_line:
            self.next_comment += 1
            if separate and not emitted:
                if self.out and self.out[-1] != "":
                    self.out.append("")
            else:
                self._gap(comment.span.line)
            self._emit([_INDENT * depth + comment.text], comment.span.line)
            emitted = True
        return emitted

    def trailing(self, key: object) -> str:
        """The end-of-line comment that belongs to ``key``, as text to append."""
        comment = self.owned.get(key)
        return "  " + comment.text if comment is not None else ""

    def rest(self) -> None:
        """Comments after the last block."""
        while (comment := self._peek()) is not None:
            self.next_comment += 1
            self._gap(comment.span.line)
            self._emit([comment.text], comment.span.line)

    # -- statements
    def statements(self, items: Sequence[ast.Node], depth: int) -> None:
        """The statements of one block, aligned in runs, with their comments."""
        widths, runs = self._alignment(items)
        commented: dict[int, list[tuple[int, int]]] = {}  # run -> (output index, code width)
        for i, item in enumerate(items):
            # A simple statement's inner comments (a multi-line call) move above it;
            # a block places its inner comments itself.
            self.leading(item.span.line if _is_block(item) else item.span.end_line, depth)
            self._gap(item.span.line)
            if _is_block(item):
                self.block(item, depth)
                continue
            lines = self._simple(item, widths[i], depth)
            comment = self.trailing(id(item))
            if comment and len(lines) == 1 and runs[i] is not None:
                commented.setdefault(runs[i], []).append((len(self.out), len(lines[0])))
            lines[-1] += comment
            self._emit(lines, item.span.end_line)
        # End-of-line comments of one run line up, two spaces past its longest commented line
        # of at most ALIGN_MAX characters; a longer line keeps its comment where it is (one
        # long value would otherwise pad every comment of the run out to it).
        for entries in commented.values():
            column = max((width for _, width in entries if width <= ALIGN_MAX), default=0)
            for index, width in entries:
                if width <= column:
                    code, comment = self.out[index][:width], self.out[index][width:]
                    self.out[index] = code.ljust(column) + comment

    def _alignment(self, items: Sequence[ast.Node]) -> tuple[list[int], list[int | None]]:
        """Per statement: the width to pad its left side to (the widest in its run), and
        its run's number (None outside runs). A run is adjacent statements of one kind
        with no blank line and no printed comment line between them."""
        widths = [0] * len(items)
        runs: list[int | None] = [None] * len(items)
        run: list[int] = []

        def close() -> None:
            width = max((len(_left(items[j])) for j in run), default=0)
            for j in run:
                widths[j] = width
                runs[j] = run[0]
            run.clear()

        for i, item in enumerate(items):
            if _left(item) is None:
                close()
                continue
            if run:
                prev = items[run[-1]]
                between = any(prev.span.end_line <= c.span.line < item.span.end_line
                              for c in self.pending)
                if item.span.line > prev.span.end_line + 1 or between \
                        or type(item) is not type(prev):
                    close()
            run.append(i)
        close()
        return widths, runs

    def _simple(self, item: ast.Node, width: int, depth: int) -> list[str]:
        pad = _INDENT * depth
        left = _left(item).ljust(width)
        if isinstance(item, ast.Field):
            return _value_lines(f"{pad}{left} = ", item.value)
        if isinstance(item, ast.Distribution):
            lines = _value_lines(f"{pad}{left} ~ ", item.dist)
            if item.clamp is not None:
                lines[-1] += f" clamp [{expr_text(item.clamp[0])}, {expr_text(item.clamp[1])}]"
            return lines
        if isinstance(item, ast.Constraint):
            return _value_lines(f"{pad}{left} {item.op} ", item.value)
        if isinstance(item, ast.Projector):
            return _value_lines(f"{pad}{left} : ", item.fields[0].value)
        raise AssertionError(type(item).__name__)

    def block(self, node: ast.Node, depth: int) -> None:
        pad = _INDENT * depth
        header, children = _header(node)
        # A comment after the '{' on the header's line, before any child, stays there.
        header_comment = ""
        comment = self._peek()
        if comment is not None and comment.span.line == node.span.line and \
                node.span.end_line > node.span.line and \
                (not children or children[0].span.line > node.span.line):
            self.next_comment += 1
            header_comment = "  " + comment.text
        closing = self.trailing(("close", id(node)))
        if not children and not header_comment and not self._waiting_before(node.span.end_line):
            self._emit([f"{pad}{header} {{}}{closing}"], node.span.end_line)
            return
        self._emit([f"{pad}{header} {{{header_comment}"], node.span.line)
        self.block_start = True
        self.statements(children, depth + 1)
        self.leading(node.span.end_line, depth + 1)
        self._emit([f"{pad}}}{closing}"], node.span.end_line)

    def _waiting_before(self, line: int) -> bool:
        comment = self._peek()
        return comment is not None and comment.span.line < line


def _left(item: ast.Node) -> str | None:
    """The part of a simple statement that is aligned across a run."""
    if isinstance(item, ast.Field):
        return item.key
    if isinstance(item, ast.Distribution):
        return f"{item.modality}.{item.quantity}"
    if isinstance(item, ast.Constraint):
        return f"{item.axis}({item.target})"
    if isinstance(item, ast.Projector) and item.short:
        return f"projector {item.source} -> {item.target}"
    return None


def _header(node: ast.Node) -> tuple[str, Sequence[ast.Node]]:
    if isinstance(node, ast.ModelBlock):
        return "model", node.items
    if isinstance(node, ast.DataBlock):
        return "data" + (f" {node.name}" if node.name else ""), node.items
    if isinstance(node, ast.ClusterBlock):
        return "cluster" + (f" {node.name}" if node.name else ""), node.fields
    if isinstance(node, ast.TrainBlock):
        return "train", node.fields
    if isinstance(node, ast.ConstraintsBlock):
        return "constraints", node.constraints
    if isinstance(node, ast.Module):
        modality = f" ({node.modality})" if node.modality else ""
        return f"{node.role} {node.name}{modality}", node.fields
    if isinstance(node, ast.Projector):
        return f"projector {node.source} -> {node.target}", node.fields
    raise AssertionError(type(node).__name__)


def format_spec(spec: ast.Spec) -> str:
    """The canonical text of a spec; ``parse(format_spec(s))`` has the same meaning as ``s``."""
    printer = _Printer(spec)
    if spec.name is not None:
        line = spec.name_span.line
        printer.leading(line, 0)
        printer._gap(line)
        printer._emit([f"spec {spec.name}" + printer.trailing("spec")], line)
    for block in spec.blocks:
        if printer.leading(block.span.line, 0, separate=True):
            printer._gap(block.span.line)
        elif printer.out and printer.out[-1] != "":
            printer.out.append("")
        printer.block(block, 0)
    printer.rest()
    while printer.out and printer.out[-1] == "":
        printer.out.pop()
    return "\n".join(line.rstrip() for line in printer.out) + "\n" if printer.out else ""
