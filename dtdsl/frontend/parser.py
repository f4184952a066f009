"""Parse spec text into the AST (``dtdsl.frontend.ast``), reporting syntax errors.

The grammar is ``grammar/dtdsl.lark`` (LALR). Before lark runs, a bracket scan
rejects absurd nesting (so no later recursive pass can overflow the stack),
reports unbalanced brackets precisely and collects comments for ``dtc fmt``.
When the spec has syntax errors, each top-level block is parsed on its own so
that every block's first error is reported, not only the file's first.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

from lark import Lark, Token, Transformer, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from dtdsl.codes import DT101, DT102, DT103, DT104, DT105, DT107, DT108
from dtdsl.diagnostics import Diagnostic, did_you_mean
from dtdsl.frontend import ast
from dtdsl.resources import grammar_text
from dtdsl.source import Source, Span

__all__ = ["MAX_NESTING", "ParseResult", "UNITS", "parse"]

MAX_NESTING = 64
MAX_DIGITS = 40
_MAX_SYNTAX_ERRORS = 50

# Every unit suffix the NUMBER terminal accepts (kept in step with the grammar by a test).
UNITS = ("TFLOP/s", "PFLOP/s", "GFLOP/s", "TFLOPS", "PFLOPS", "GFLOPS", "Gbps", "Tbps", "Mbps",
         "Gb/s", "GB/s", "Tb/s", "TB/s", "Mb/s", "MB/s", "KiB", "MiB", "GiB", "TiB", "KB", "MB",
         "GB", "TB", "ms", "us", "B", "s", "k", "M", "%")

TOP_KEYWORDS = ("spec", "model", "data", "cluster", "train", "constraints")

_SCAN = re.compile(
    r'"(?:[^"\\\n]|\\[^\n])*"'          # a string: brackets and '#' inside do not count
    r'|(?P<unclosed>"(?:[^"\\\n]|\\[^\n])*\\?)(?=\n|\Z)'   # one the line or file ends
    r"|(?P<comment>#[^\n]*)"
    r"|(?P<control>[\x00-\x08\x0b\x0e-\x1f\x7f])"    # not whitespace: an escape, say
    r"|(?P<open>[{\[(])|(?P<close>[}\])])"
    r"|(?P<newline>\n)"
    r"|^[ \t]*(?P<top>" + "|".join(TOP_KEYWORDS) + r")\b",
    re.MULTILINE,
)
_CLOSER = {"{": "}", "[": "]", "(": ")"}
_NUMBER = re.compile(r"(\d[\d_]*(?:\.\d+)?(?:[eE][+-]?\d+)?)[ \t]*(.*)", re.DOTALL)
_ESCAPES = {'"': '"', "\\": "\\", "n": "\n", "t": "\t"}

_TERMINAL_WORDS = {
    "NAME": "a name",
    "NUMBER": "a number",
    "STRING": "a string",
    "SCHED_1F1B": "'1f1b'",
    "STAR": "'*'",
    "$END": "the end of the file",
}
_VALUE_TERMINALS = frozenset({"NUMBER", "STRING", "NAME", "LSQB", "LBRACE", "MINUS", "TRUE",
                              "FALSE", "SCHED_1F1B"})


@dataclass(frozen=True)
class ParseResult:
    spec: ast.Spec | None
    diagnostics: tuple[Diagnostic, ...]


@functools.lru_cache(maxsize=1)
def _lark() -> Lark:
    return Lark(grammar_text(), parser="lalr", lexer="contextual", propagate_positions=True,
                maybe_placeholders=False)


# What follows a word used as a name: a field or argument (`=`, not `==`), a call or
# constraint (`(`), or a data quantity (`.`).
_USED_AS_NAME = re.compile(r"\s*(?:=(?!=)|\(|\.)")


def _keyword_as_name(err: UnexpectedInput) -> bool:
    """Error handler: a keyword the parser cannot take here is an ordinary name.

    The lexer reads a word as a keyword wherever the LALR tables list that keyword as a
    lookahead, and merged states list ``encoder``, ``backbone``, ``generator``,
    ``projector`` and ``clamp`` after every expression. So ``clamp = 1`` after another
    field would be a syntax error, while the same field first in its block parses. When
    the parser rejects such a keyword, accepts a name instead, and the word is used as
    a name, feed it again as a name and go on; anything else stays a syntax error.
    """
    if not isinstance(err, UnexpectedToken):
        return False
    token = err.token
    if token.type in ("NAME", "$END") or not token.value.isidentifier():
        return False
    text = err.interactive_parser.lexer_thread.state.text
    text = getattr(text, "text", text)
    if not _USED_AS_NAME.match(text, token.end_pos) or "NAME" not in _accepted(err):
        return False
    err.interactive_parser.feed_token(Token.new_borrow_pos("NAME", token.value, token))
    return True


def _parse_tree(text: str):
    return _lark().parse(text, on_error=_keyword_as_name)


def _span(item) -> Span:
    return Span(line=item.line, column=item.column, end_line=item.end_line,
                end_column=item.end_column)


def _describe_terminal(name: str) -> str:
    if name in _TERMINAL_WORDS:
        return _TERMINAL_WORDS[name]
    for term in _lark().terminals:
        if term.name == name and term.pattern.type == "str":
            return f"'{term.pattern.value}'"
    return name.lower()


def _describe_expected(expected: set[str]) -> str:
    words = []
    if expected >= {"NUMBER", "STRING", "NAME"}:
        words.append("a value (a number, string, name, list, set or call)")
        expected = expected - _VALUE_TERMINALS
    words += sorted(_describe_terminal(t) for t in expected)
    if not words:
        return "nothing more"
    if len(words) == 1:
        return words[0]
    return ", ".join(words[:-1]) + " or " + words[-1]


def _describe_token(token: Token) -> str:
    if token.type == "$END":
        return "end of file"
    if token.type == "NAME":
        return f"name '{token.value}'"
    if token.type == "NUMBER":
        return f"number {token.value}"
    if token.type == "STRING":
        return f"string {token.value}"
    if token.value.isalpha():
        return f"keyword '{token.value}'"
    return f"'{token.value}'"


# ---- bracket scan ------------------------------------------------------------

@dataclass(frozen=True)
class _Scan:
    comments: tuple[ast.Comment, ...]
    block_lines: tuple[int, ...]      # lines where a top-level keyword starts at depth 0
    diagnostics: tuple[Diagnostic, ...]
    too_deep: bool


def _scan(text: str) -> _Scan:
    comments: list[ast.Comment] = []
    block_lines: list[int] = []
    diags: list[Diagnostic] = []
    lexical: list[Diagnostic] = []      # unclosed strings, control characters
    stack: list[tuple[str, Span]] = []
    line, line_start = 1, 0
    for m in _SCAN.finditer(text):
        kind = m.lastgroup
        if kind == "newline":
            line, line_start = line + 1, m.end()
            continue
        column = m.start() - line_start + 1
        if kind == "unclosed":
            lexical.append(Diagnostic.error(
                DT103, "string is not closed before the end of the line",
                Span.point(line, column), hint='close it with a \'"\' on the same line'))
        elif kind == "control":
            lexical.append(Diagnostic.error(
                DT101, f"unexpected character U+{ord(m.group()):04X}", Span.point(line, column),
                hint="a control character has no place in a spec outside strings and "
                "comments (a terminal's colour codes pasted with it?): remove it"))
        elif kind == "comment":
            comments.append(ast.Comment(text=m.group().rstrip("\r"), span=Span(
                line=line, column=column, end_line=line, end_column=column + len(m.group()))))
        elif kind == "top":
            if not stack:
                block_lines.append(line)
        elif kind == "open":
            stack.append((m.group(), Span.point(line, column)))
            if len(stack) > MAX_NESTING:
                return _Scan(comments=(), block_lines=(), too_deep=True, diagnostics=(
                    Diagnostic.error(
                        DT104, f"brackets nest more than {MAX_NESTING} deep here",
                        Span.point(line, column),
                        hint="no spec needs this much nesting; check for a run of "
                        "unclosed brackets"),))
        elif kind == "close":
            closer = m.group()
            if not stack:
                diags.append(Diagnostic.error(
                    DT102, f"'{closer}' closes nothing", Span.point(line, column),
                    hint="remove it, or add the bracket it should close"))
            elif _CLOSER[stack[-1][0]] != closer:
                opener, where = stack.pop()
                diags.append(Diagnostic.error(
                    DT102, f"'{closer}' does not match the '{opener}' opened at {where}; "
                    f"expected '{_CLOSER[opener]}'", Span.point(line, column),
                    notes=[f"'{opener}' opened at line {where.line}, column {where.column}"]))
            else:
                stack.pop()
    # An unclosed string may hold the closing brackets, a pasted escape sequence open one
    # ("\x1b[31m"): they are the errors to show, not brackets left open at the end.
    if lexical:
        diags, stack = diags + lexical, []
    for opener, where in reversed(stack[-5:]):
        diags.append(Diagnostic.error(
            DT102, f"'{opener}' is never closed", where,
            hint=f"add '{_CLOSER[opener]}' where the {'block' if opener == '{' else 'list'} ends"))
    return _Scan(comments=tuple(comments), block_lines=tuple(block_lines),
                 diagnostics=tuple(diags), too_deep=False)


# ---- syntax errors -----------------------------------------------------------

# A number followed on the same line by a word: a unit the lexer did not know.
_UNIT_TYPO = re.compile(r"\d[ \t]*([A-Za-z_][A-Za-z0-9_]*)[ \t]*(?:#[^\n]*)?\s*$")


def _span_at(text: str, offset: int, length: int, line_offset: int) -> Span:
    line = text.count("\n", 0, offset) + 1
    column = offset - (text.rfind("\n", 0, offset) + 1) + 1
    return Span(line=line + line_offset, column=column, end_line=line + line_offset,
                end_column=column + length)


def _unit_diagnostic(word: str, where: Span, number: str = "") -> Diagnostic:
    if (number + word).lower() == "1f1b":
        return Diagnostic.error(DT101, f"unexpected '{number}{word}'", where,
                                hint="schedule names are lowercase: 1f1b")
    guess = did_you_mean(word, UNITS)
    return Diagnostic.error(
        DT107, f"unknown unit '{word}' after a number", where,
        notes=["units: " + ", ".join(UNITS)],
        hint=f"did you mean '{guess}'?" if guess else "write the value without a unit, "
        "or with one of the units listed")


def _accepted(err: UnexpectedInput) -> set[str]:
    """The terminals the parser would really accept here (LALR's own list over-approximates)."""
    interactive = getattr(err, "interactive_parser", None)
    if interactive is not None:
        try:
            return set(interactive.accepts())
        except Exception:  # noqa: BLE001 - a best-effort refinement of a message
            pass
    return set(getattr(err, "expected", ()) or ())


# A keyword where the parser wanted a name, and it is not used as a name (no `=`, `(` or
# `.` after it, so _keyword_as_name left it alone): what the user probably meant.
_DECLARATION_HINT = ("`{0} ...` declares {1} directly inside `model {{ }}`; if this is one, "
                     "close the block before it")
_KEYWORD_HINTS = {
    **{kw: _DECLARATION_HINT.format(kw, "a module") for kw in ("encoder", "backbone",
                                                               "generator")},
    "projector": _DECLARATION_HINT.format("projector", "a projector"),
    "clamp": "`clamp [low, high]` goes right after a distribution: "
             "`text.tokens ~ lognormal(median=256, sigma=0.8) clamp [16, 2048]`",
}
# A keyword the parser took as such, followed by `=`: it cannot name a field or argument there.
_KEYWORD_AS_VALUE = {
    "clamp": "right after a distribution, `clamp` starts its bounds: `clamp [low, high]`",
    "true": "`true` is a value here, so it cannot name an argument",
    "false": "`false` is a value here, so it cannot name an argument",
}


# How much of the text before an error the hints' patterns look at: they match at its
# end, and over a whole long block (a 60 KB comment) backtracking made them quadratic.
_TAIL = 512


def _tail(text: str, end: int) -> tuple[str, int]:
    """The last ``_TAIL`` characters of ``text[:end]`` and where they start in ``text``."""
    start = max(0, end - _TAIL)
    return text[start:end], start


def _syntax_diagnostic(err: UnexpectedInput, text: str, line_offset: int) -> Diagnostic:
    if isinstance(err, UnexpectedCharacters):
        where = Span.point(err.line + line_offset, err.column)
        char = text[err.pos_in_stream] if err.pos_in_stream < len(text) else ""
        if char == '"':
            return Diagnostic.error(DT103, "string is not closed before the end of the line",
                                    where, hint='close it with a \'"\' on the same line')
        tail, at = _tail(text, err.pos_in_stream)
        typo = _UNIT_TYPO.search(tail)
        if typo and char == "/":
            return _unit_diagnostic(typo.group(1) + "/", _span_at(
                text, at + typo.start(1), len(typo.group(1)) + 1, line_offset))
        shown = repr(char) if char.isprintable() else f"U+{ord(char):04X}"
        hint = None
        if char in "\u201c\u201d\u2018\u2019":
            hint = "use straight double quotes (\") around strings"
        elif char == ";":
            hint = "statements need no separator; put each on its own line"
        return Diagnostic.error(DT101, f"unexpected character {shown}", where, hint=hint)
    assert isinstance(err, (UnexpectedToken, UnexpectedEOF)), type(err)
    token = getattr(err, "token", None)
    expected = _accepted(err) - {"$END"} if token is not None and token.type != "$END" \
        else _accepted(err)
    if token is None or token.type == "$END" or getattr(token, "line", None) is None:
        lines = text.split("\n")
        where = Span.point(len(lines) + line_offset, len(lines[-1]) + 1)
        return Diagnostic.error(DT102, f"unexpected end of file; expected "
                                f"{_describe_expected(expected)}", where)
    where = Span(line=token.line + line_offset, column=token.column,
                 end_line=token.end_line + line_offset, end_column=token.end_column)
    before, at = _tail(text, token.start_pos)
    after = text[token.end_pos:token.end_pos + 80]
    number = re.search(r"(\d+)[ \t]*$", before)
    if token.type == "NAME" and number \
            and not re.match(r"[ \t]*=", after) and "COMMA" not in expected:
        return _unit_diagnostic(token.value, where, number.group(1))
    typo = _UNIT_TYPO.search(before)
    if typo and expected and expected <= {"EQUAL", "DOT"}:
        digit = before[typo.start()]
        return _unit_diagnostic(typo.group(1), _span_at(text, at + typo.start(1),
                                                        len(typo.group(1)), line_offset),
                                digit if typo.start(1) == typo.start() + 1 else "")
    message = f"unexpected {_describe_token(token)}; expected {_describe_expected(expected)}"
    hint = None
    if "COMMA" in expected and token.type in {"NAME", "NUMBER", "STRING", "LSQB"}:
        hint = "separate arguments and items with ','"
    elif token.type == "NAME" and expected == {"EQUAL"}:
        hint = f"a field is written `{token.value} = value`"
    elif token.type != "NAME" and token.value.isidentifier() and "NAME" in expected:
        hint = _KEYWORD_HINTS.get(token.value, f"'{token.value}' is a keyword here")
    elif token.type == "EQUAL" and (word := re.search(r"([A-Za-z_]\w*)\s*$", before)) \
            and word.group(1) in _KEYWORD_AS_VALUE:
        hint = _KEYWORD_AS_VALUE[word.group(1)]
    return Diagnostic.error(DT101, message, where, hint=hint)


def _syntax_errors(text: str, scan: _Scan, first: UnexpectedInput) -> list[Diagnostic]:
    """Every top-level block's first syntax error, plus the bracket scan's findings."""
    diags = list(scan.diagnostics)
    bracket_lines = {d.span.line for d in scan.diagnostics}
    lines = text.split("\n")
    starts = list(scan.block_lines) or [1]
    if starts[0] != 1:
        starts.insert(0, 1)
    bounds = list(zip(starts, starts[1:] + [len(lines) + 1], strict=True))
    for start, end in bounds:
        if any(start <= line < end for line in bracket_lines):
            continue  # the bracket error already explains this block
        chunk = "\n".join(lines[start - 1:end - 1])
        try:
            _parse_tree(chunk)
        except UnexpectedInput as err:
            diags.append(_syntax_diagnostic(err, chunk, start - 1))
        if len(diags) >= _MAX_SYNTAX_ERRORS:
            break
    if not diags:
        diags.append(_syntax_diagnostic(first, text, 0))
    unique = {(d.span.line, d.span.column, d.code): d for d in diags}
    return sorted(unique.values(), key=lambda d: (d.span.line, d.span.column))


# ---- tree to AST ---------------------------------------------------------------

class _Builder(Transformer):
    """Turns lark's parse tree into AST nodes, collecting literal errors (bad numbers)."""

    def __init__(self) -> None:
        super().__init__()
        self.diagnostics: list[Diagnostic] = []

    @staticmethod
    def _meta_span(meta) -> Span:
        return _span(meta)

    # -- literals
    def number(self, children):
        (tok,) = children
        return self._number(tok, negative=False)

    @v_args(meta=True)
    def neg_number(self, meta, children):
        (tok,) = children
        num = self._number(tok, negative=True)
        return num.model_copy(update={"span": _span(meta)})

    def _number(self, tok: Token, negative: bool) -> ast.Number:
        digits, unit = _NUMBER.fullmatch(tok.value).groups()
        plain = digits.replace("_", "")
        value: int | float = 0
        if len(re.sub(r"\D", "", plain.split("e")[0].split("E")[0])) > MAX_DIGITS:
            self.diagnostics.append(Diagnostic.error(
                DT105, f"number has {len(plain)} digits; numbers are limited to {MAX_DIGITS}",
                _span(tok), hint="no setting needs a number this large; use a unit suffix "
                "(k, M, GiB, TFLOPS) for big values"))
        elif re.search(r"[.eE]", plain):
            value = float(plain)
            if not math.isfinite(value):
                self.diagnostics.append(Diagnostic.error(
                    DT105, f"number {digits} is too large to represent", _span(tok)))
                value = 0.0
        else:
            value = int(plain)
        if negative:
            value = -value
            digits = "-" + digits
        return ast.Number(value=value, unit=unit or None, digits=digits, span=_span(tok))

    def string(self, children):
        (tok,) = children
        out, i, raw = [], 1, tok.value
        while i < len(raw) - 1:
            char = raw[i]
            if char == "\\":
                esc = raw[i + 1]
                if esc not in _ESCAPES:
                    col = tok.column + i
                    self.diagnostics.append(Diagnostic.error(
                        DT108, f"unknown escape '\\{esc}' in string",
                        Span(line=tok.line, column=col, end_line=tok.line, end_column=col + 2),
                        hint='escapes are \\" \\\\ \\n \\t; write \\\\ for a backslash'))
                out.append(_ESCAPES.get(esc, esc))
                i += 2
            else:
                out.append(char)
                i += 1
        return ast.String(value="".join(out), span=_span(tok))

    @v_args(meta=True)
    def true(self, meta, children):
        return ast.Bool(value=True, span=_span(meta))

    @v_args(meta=True)
    def false(self, meta, children):
        return ast.Bool(value=False, span=_span(meta))

    def name(self, children):
        (tok,) = children
        return ast.Name(name=tok.value, span=_span(tok))

    @v_args(meta=True)
    def ref(self, meta, children):
        return ast.Ref(parts=tuple(t.value for t in children), span=_span(meta))

    @staticmethod
    def _values(children):
        return tuple(c for c in children if not isinstance(c, Token))

    @v_args(meta=True)
    def list(self, meta, children):
        return ast.ListExpr(items=self._values(children), span=_span(meta))

    @v_args(meta=True)
    def set(self, meta, children):
        return ast.SetExpr(items=self._values(children), span=_span(meta))

    @v_args(meta=True)
    def range(self, meta, children):
        low, _, high = children
        return ast.Range(low=low, high=high, span=_span(meta))

    @v_args(meta=True)
    def kwarg(self, meta, children):
        key, value = children
        return ast.Arg(name=key.value, value=value, span=_span(meta))

    @v_args(meta=True)
    def call(self, meta, children):
        func = children[0]
        args = tuple(c if isinstance(c, ast.Arg) else ast.Arg(name=None, value=c, span=c.span)
                     for c in self._values(children[1:]))
        return ast.Call(func=func.value, func_span=_span(func), args=args, span=_span(meta))

    # -- statements
    @v_args(meta=True)
    def field(self, meta, children):
        key, value = children
        return ast.Field(key=key.value, key_span=_span(key), value=value, span=_span(meta))

    @v_args(meta=True)
    def quantity(self, meta, children):
        return (children[0].value, children[1].value, _span(meta))

    @v_args(meta=True)
    def clamp(self, meta, children):
        return self._values(children)

    @v_args(meta=True)
    def distribution(self, meta, children):
        (modality, quantity, target_span), dist, *rest = children
        return ast.Distribution(modality=modality, quantity=quantity, target_span=target_span,
                                dist=dist, clamp=rest[0] if rest else None, span=_span(meta))

    @v_args(meta=True)
    def selector(self, meta, children):
        return children[0]

    def role(self, children):
        return children[0]

    def cmp(self, children):
        return children[0]

    @v_args(meta=True)
    def constraint(self, meta, children):
        axis, _, target, _, op, value = children
        return ast.Constraint(axis=axis.value, axis_span=_span(axis), target=target.value,
                              target_span=_span(target), op=op.value, value=value,
                              span=_span(meta))

    # -- declarations and blocks
    @v_args(meta=True)
    def modality(self, meta, children):
        return children[1]

    @v_args(meta=True)
    def module_decl(self, meta, children):
        role, name, *rest = children
        modality = rest[0] if rest and isinstance(rest[0], Token) and rest[0].type == "NAME" \
            else None
        return ast.Module(role=role.value, name=name.value, name_span=_span(name),
                          modality=modality.value if modality else None,
                          modality_span=_span(modality) if modality else None,
                          fields=self._values(rest), span=_span(meta))

    def _projector(self, meta, children, short: bool):
        source, _, target, *rest = children
        values = self._values(rest)
        if short:
            (arch,) = values
            values = (ast.Field(key="arch", key_span=arch.span, value=arch, span=arch.span),)
        return ast.Projector(source=source.value, source_span=_span(source),
                             target=target.value, target_span=_span(target), short=short,
                             fields=values, span=_span(meta))

    @v_args(meta=True)
    def projector_short(self, meta, children):
        return self._projector(meta, children, short=True)

    @v_args(meta=True)
    def projector_block(self, meta, children):
        return self._projector(meta, children, short=False)

    @v_args(meta=True)
    def model_block(self, meta, children):
        return ast.ModelBlock(items=self._values(children), span=_span(meta))

    @staticmethod
    def _block_name(children):
        first = children[0] if children else None
        return first.value if isinstance(first, Token) and first.type == "NAME" else None

    @v_args(meta=True)
    def data_block(self, meta, children):
        return ast.DataBlock(name=self._block_name(children), items=self._values(children),
                             span=_span(meta))

    @v_args(meta=True)
    def cluster_block(self, meta, children):
        return ast.ClusterBlock(name=self._block_name(children), fields=self._values(children),
                                span=_span(meta))

    @v_args(meta=True)
    def train_block(self, meta, children):
        return ast.TrainBlock(fields=self._values(children), span=_span(meta))

    @v_args(meta=True)
    def constraints_block(self, meta, children):
        return ast.ConstraintsBlock(constraints=self._values(children), span=_span(meta))

    @v_args(meta=True)
    def spec_header(self, meta, children):
        return children[0]

    @v_args(meta=True)
    def start(self, meta, children):
        name = children[0] if children and isinstance(children[0], Token) else None
        span = Span.point(1, 1) if meta.empty else _span(meta)
        return ast.Spec(name=name.value if name else None,
                        name_span=_span(name) if name else None,
                        blocks=self._values(children), span=span)


def parse(source: Source) -> ParseResult:
    """Parse a spec. On syntax errors the result has no AST and every error found."""
    text = source.text
    scan = _scan(text)
    if scan.too_deep:
        return ParseResult(spec=None, diagnostics=scan.diagnostics)
    try:
        tree = _parse_tree(text)
    except UnexpectedInput as err:
        return ParseResult(spec=None, diagnostics=tuple(_syntax_errors(text, scan, err)))
    builder = _Builder()
    spec = builder.transform(tree)
    spec = spec.model_copy(update={"comments": scan.comments})
    if builder.diagnostics:
        return ParseResult(spec=None, diagnostics=tuple(builder.diagnostics))
    return ParseResult(spec=spec, diagnostics=())
