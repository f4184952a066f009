"""``dtc fmt``: print a spec's AST in the canonical layout, keeping its comments.

The layout: two-space indentation; one statement per line; one blank line
between top-level blocks; at most one blank line kept between statements;
``=``, ``~`` and constraint operators aligned across a run of adjacent
statements; calls wider than the line limit wrapped under their open
parenthesis. Comments stay where they were: own-line comments before the
statement that follows them, end-of-line comments at the end of their
statement's last line (a comment inside a multi-line statement moves above it).
The output depends only on the AST and the comments, so formatting is idempotent.
"""

from __future__ import annotations

from collections.abc import Sequence

from dtdsl.frontend import ast

__all__ = ["LINE_WIDTH", "format_spec"]

LINE_WIDTH = 100
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


class _Printer:
    def __init__(self, comments: Sequence[ast.Comment]) -> None:
        self.comments = sorted(comments, key=lambda c: c.span.line)
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

    def leading(self, before_line: int, depth: int, separate: bool = False) -> bool:
        """Emit own-line comments that come before ``before_line``; True if any were.

        With ``separate`` (top-level blocks) the first comment is set off by a blank line.
        """
        emitted = False
        while self.next_comment < len(self.comments) and \
                self.comments[self.next_comment].span.line < before_line:
            comment = self.comments[self.next_comment]
            self.next_comment += 1
            if separate and not emitted:
                if self.out and self.out[-1] != "":
                    self.out.append("")
            else:
                self._gap(comment.span.line)
            self._emit([_INDENT * depth + comment.text], comment.span.line)
            emitted = True
        return emitted

    def trailing(self, line: int) -> str:
        """The end-of-line comment on ``line``, if any, as text to append."""
        if self.next_comment < len(self.comments) and \
                self.comments[self.next_comment].span.line == line:
            comment = self.comments[self.next_comment]
            self.next_comment += 1
            return "  " + comment.text
        return ""

    def rest(self) -> None:
        """Comments after the last block."""
        while self.next_comment < len(self.comments):
            comment = self.comments[self.next_comment]
            self.next_comment += 1
            self._gap(comment.span.line)
            self._emit([comment.text], comment.span.line)

    # -- statements
    def statements(self, items: Sequence[ast.Node], depth: int) -> None:
        """The statements of one block, aligned in runs, with their comments."""
        widths, runs = self._alignment(items)
        commented: dict[int, list[tuple[int, int]]] = {}  # run -> (output index, code width)
        for i, item in enumerate(items):
            is_block = isinstance(item, (ast.Module, ast.Projector)) and \
                not (isinstance(item, ast.Projector) and item.short)
            # A simple statement's inner comments (a multi-line call) move above it;
            # a block places its inner comments itself.
            self.leading(item.span.line if is_block else item.span.end_line, depth)
            self._gap(item.span.line)
            shares_line = i + 1 < len(items) and items[i + 1].span.line == item.span.end_line
            if is_block:
                self.block(item, depth, shares_line)
            else:
                lines = self._simple(item, widths[i], depth)
                comment = "" if shares_line else self.trailing(item.span.end_line)
                if comment and len(lines) == 1 and runs[i] is not None:
                    commented.setdefault(runs[i], []).append((len(self.out), len(lines[0])))
                lines[-1] += comment
                self._emit(lines, item.span.end_line)
        # End-of-line comments of one run line up, one space past its longest commented line.
        for entries in commented.values():
            column = max(width for _, width in entries)
            for index, width in entries:
                code, comment = self.out[index][:width], self.out[index][width:]
                self.out[index] = code.ljust(column) + comment

    def _alignment(self, items: Sequence[ast.Node]) -> tuple[list[int], list[int | None]]:
        """Per statement: the width to pad its left side to (the widest in its run), and
        its run's number (None outside runs)."""
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
                # Adjacent in the output: no blank line between them in the source and no
                # comment that will be printed between them (one before `item`, or inside it).
                prev = items[run[-1]]
                shared = item.span.line == prev.span.end_line
                between = any(c.span.line < item.span.end_line and
                              (c.span.line > prev.span.end_line or
                               (shared and c.span.line == prev.span.end_line))
                              for c in self.comments)
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

    def block(self, node: ast.Node, depth: int, shares_line: bool = False) -> None:
        pad = _INDENT * depth
        header, children = _header(node)
        first_child_line = children[0].span.line if children else None
        header_comment = ""
        if first_child_line is None or first_child_line > node.span.line:
            header_comment = self.trailing(node.span.line) if \
                node.span.end_line > node.span.line else ""
        if not children and not self._comments_before(node.span.end_line):
            line = f"{pad}{header} {{}}" + header_comment
            if not header_comment and not shares_line:
                line += self.trailing(node.span.end_line)
            self._emit([line], node.span.end_line)
            return
        self._emit([f"{pad}{header} {{{header_comment}"], node.span.line)
        self.block_start = True
        self.statements(children, depth + 1)
        self.leading(node.span.end_line, depth + 1)
        closing = f"{pad}}}"
        self._emit([closing + ("" if shares_line else self.trailing(node.span.end_line))],
                   node.span.end_line)

    def _comments_before(self, line: int) -> bool:
        return self.next_comment < len(self.comments) and \
            self.comments[self.next_comment].span.line < line


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
    printer = _Printer(spec.comments)
    blocks = spec.blocks
    if spec.name is not None:
        line = spec.name_span.line
        printer.leading(line, 0)
        printer._gap(line)
        shared = bool(blocks) and blocks[0].span.line == line
        printer._emit([f"spec {spec.name}" + ("" if shared else printer.trailing(line))], line)
    for i, block in enumerate(blocks):
        if printer.leading(block.span.line, 0, separate=True):
            printer._gap(block.span.line)
        elif printer.out and printer.out[-1] != "":
            printer.out.append("")
        shares_line = i + 1 < len(blocks) and blocks[i + 1].span.line == block.span.end_line
        printer.block(block, 0, shares_line)
    printer.rest()
    while printer.out and printer.out[-1] == "":
        printer.out.pop()
    return "\n".join(line.rstrip() for line in printer.out) + "\n" if printer.out else ""
