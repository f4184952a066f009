"""Parsing: the AST, spans, literals, and the syntax errors of bad input."""

from __future__ import annotations

import re

import pytest

from dtdsl.driver import run_frontend
from dtdsl.frontend import ast
from dtdsl.frontend.parser import MAX_NESTING, UNITS, parse
from dtdsl.frontend.units import DIMENSIONS
from dtdsl.resources import grammar_text
from dtdsl.source import MAX_SPEC_BYTES, Source


def _parse(text: str) -> ast.Spec:
    result = parse(Source(name="t.dt", text=text))
    assert result.spec is not None, result.diagnostics
    return result.spec


def _codes(data: bytes | str) -> list[tuple[str, int, int]]:
    if isinstance(data, str):
        data = data.encode()
    result = run_frontend("t.dt", data, stop_after="ast")
    return [(d.code, d.span.line, d.span.column) for d in result.diagnostics]


def test_units_agree_with_grammar_and_dimensions():
    regex = re.search(r"NUMBER: /(.*)/", grammar_text()).group(1)
    in_grammar = set(re.search(r"\(\?:(TFLOP.*?%)\)", regex).group(1).replace("\\/", "/")
                     .split("|"))
    assert in_grammar == set(UNITS)
    assert set(UNITS) == {u for d in DIMENSIONS.values() for u in d.factors}


def test_numbers_units_and_spans():
    spec = _parse("cluster c {\n  gpu = H800(memory = 80 GiB)\n  net = 400 Gb/s  m = 90%\n"
                  "  k = 4k  big = 1_000  f = 1.5e3  neg = -2\n}\n")
    fields = {f.key: f for f in spec.blocks[0].fields}
    mem = fields["gpu"].value.args[0].value
    assert (mem.value, mem.unit, mem.digits) == (80, "GiB", "80")
    assert (mem.span.line, mem.span.column, mem.span.end_column) == (2, 23, 29)
    assert fields["net"].value.unit == "Gb/s"
    assert fields["m"].value.unit == "%"
    assert (fields["k"].value.value, fields["k"].value.unit) == (4, "k")
    assert fields["big"].value.value == 1000
    assert fields["f"].value.value == 1500.0
    assert fields["neg"].value.value == -2


def test_keywords_are_names_where_no_keyword_fits():
    spec = _parse("train { data = 1 in = 2 model = 3 }")
    assert [f.key for f in spec.blocks[0].fields] == ["data", "in", "model"]


def test_projector_forms_and_schedule_name():
    spec = _parse("model {\n  projector a -> b : mlp(depth=2)\n  encoder x (image) {}\n"
                  "  projector b -> c { arch = mlp() frozen = true }\n}\n"
                  "train { schedule = 1f1b }")
    short, module, block = spec.blocks[0].items
    assert short.short and short.fields[0].key == "arch"
    assert module.role == "encoder" and module.modality == "image"
    assert not block.short and [f.key for f in block.fields] == ["arch", "frozen"]
    assert spec.blocks[1].fields[0].value.name == "1f1b"


def test_strings_and_escapes():
    spec = _parse(r'data { source = "a\"b\\c\n" }')
    assert spec.blocks[0].items[0].value.value == 'a"b\\c\n'
    assert _codes(r'data { source = "a\qb" }') == [("DT108", 1, 19)]


@pytest.mark.parametrize("data, code", [
    (b"", None),
    (b"\x00\x01binary", "DT002"),
    (b"train { x = 1 }\n\xff\xfe", "DT001"),
    (b"#" * (MAX_SPEC_BYTES + 1), "DT003"),
    (b"train { x = " + b"{" * 60_000 + b"}" * 60_000 + b" }", "DT104"),
    (b"train { x = " + b"[" * (MAX_NESTING + 1) + b"]" * (MAX_NESTING + 1) + b" }", "DT104"),
    (b"train { x = " + b"9" * 400 + b" }", "DT105"),
    (b"train { x = 1e400 }", "DT105"),
    (b'train { x = "open }', "DT103"),
    (b'train { x = "open', "DT103"),     # at the end of the file, in an open block
    (b"train { x = (1 }", "DT102"),
    (b"train { x = 1", "DT102"),
    (b"train { x = 1 ; }", "DT101"),
    (b"train { x = 3 Gib }", "DT107"),
    (b"train { x = \xe2\x80\x9cq\xe2\x80\x9d }", "DT101"),
])
def test_bad_input_gets_located_diagnostics(data: bytes, code: str | None):
    codes = _codes(data)
    if code is None:
        assert codes == []
        return
    assert codes and codes[0][0] == code
    assert all(line >= 1 and column >= 1 for _, line, column in codes)


def test_a_pasted_escape_sequence_is_the_error_shown():
    assert _codes(b"train {\n  seed\x1b[31m = 1\n}\n")[0] == ("DT101", 2, 7)
    assert _codes(b"train {\x0c seed = 1 }\n") == []      # a form feed is whitespace


def test_lone_carriage_returns_end_lines():
    lf = b"train {\n  steps = 3\n  x = \"a\n}\n"
    assert _codes(lf.replace(b"\n", b"\r")) == _codes(lf) == [("DT103", 3, 7)]


def test_an_oversized_spec_says_so_without_a_wrong_size():
    from dtdsl.source import decode_source

    err = decode_source("big.dt", b"#" * (MAX_SPEC_BYTES + 1))
    assert err.message == f"spec is more than {MAX_SPEC_BYTES:,} bytes, the limit of a spec"


def test_nesting_just_under_the_limit_parses():
    depth = MAX_NESTING - 1
    assert _codes("train { x = " + "[" * depth + "]" * depth + " }") == []


def test_every_block_reports_its_first_syntax_error():
    codes = _codes("model { encoder a (image) { x = } }\ndata { t.tokens ~ }\n"
                   "train { seed = 1 }\ncluster { a = = 1 }\n")
    assert [(c, line) for c, line, _ in codes] == [("DT101", 1), ("DT101", 2), ("DT101", 4)]


def test_unit_typo_suggestion():
    result = run_frontend("t.dt", b"cluster {\n  m = 80 Gib\n}\n", stop_after="ast")
    (diag,) = result.diagnostics
    assert diag.code == "DT107" and (diag.span.line, diag.span.column) == (2, 10)
    assert "GiB" in diag.hint


@pytest.mark.parametrize("text", [
    "train { global_batch = 3  encoder = 1  backbone = 2  generator = 3 }",
    "cluster { gpus = 8  projector = 1  clamp = 2 }",
    'data { source = "x"  clamp = 3 }',
    "data { text.tokens ~ constant(5)  encoder = 3 }",
    "model { backbone llm { arch = x  generator = 1 } }",
    "constraints { tp(x) <= 2  encoder(x) <= 3 }",
    "data { text.tokens ~ constant(5)\n  projector.count ~ constant(1) }",
])
def test_keywords_name_fields_after_a_statement_too(text):
    _parse(text)


def test_keyword_field_is_an_unknown_field_wherever_it_stands():
    spec = ("model { backbone llm { arch = transformer(layers=2, hidden=64, heads=4, vocab=8) } }"
            "\ndata { text.tokens ~ constant(8) }\ncluster { gpu = H100  gpus = 8 }\n"
            "train { global_batch = 8  seq_len = 64  clamp = 1 }\n")
    result = run_frontend("t.dt", spec.encode())
    assert [(d.code, d.message) for d in result.diagnostics] == \
        [("DT201", "unknown field 'clamp' in train")]


@pytest.mark.parametrize("text, word", [
    ("train { a = 1  encoder vit (image) { } }", "declares a module"),
    ('data { source = "x"  clamp [1, 2] }', "goes right after a distribution"),
    ("data { text.tokens ~ constant(5)  clamp = 3 }", "starts its bounds"),
    ("train { x = f(true=1) }", "cannot name an argument"),
])
def test_keywords_that_stay_keywords_get_a_clear_hint(text, word):
    (d,) = parse(Source(name="t.dt", text=text)).diagnostics
    assert d.code == "DT101" and word in d.hint and "reserved" not in d.hint


def test_a_unit_typo_far_into_a_long_block_is_still_placed():
    # The hints look at the text just before the error (a bounded tail): the span is
    # still where the typo is, after a long comment.
    text = "cluster {\n  # " + "x" * 5000 + "\n  m = 80 Gib\n}\n"
    (diag,) = run_frontend("t.dt", text.encode(), stop_after="ast").diagnostics
    assert diag.code == "DT107" and (diag.span.line, diag.span.column) == (3, 10)


def test_a_syntax_error_after_a_long_run_of_letters_is_found_at_once():
    # `x = 1 = 2` after 120,000 letters: the keyword hint's pattern ran over the whole
    # block before the `=` and backtracked at every letter (85 s at 60 KB; quadratic).
    import threading

    text = "train {\n  # " + "a" * 120_000 + "\n  x = 1 = 2\n}\n"
    found: list = []
    worker = threading.Thread(target=lambda: found.extend(
        run_frontend("t.dt", text.encode(), stop_after="ast").diagnostics), daemon=True)
    worker.start()
    worker.join(60)             # a hang guard, not a timing: it takes well under a second
    assert not worker.is_alive(), "the syntax error's hints are still searching"
    assert [(d.code, d.span.line) for d in found] == [("DT101", 3)]


def test_one_long_line_does_not_push_its_runs_comments_out():
    from dtdsl.frontend.fmt import ALIGN_MAX, format_spec

    text = ('data d {\n  source = "' + "s" * 150 + '"  # where\n'
            '  samples = 10  # how many\n  tokenizer = "t"  # which\n}\n')
    spec = _parse(text)
    out = format_spec(spec)
    lines = out.splitlines()
    assert lines[2].index("#") == lines[3].index("#") < ALIGN_MAX, out
    assert lines[1].endswith('"  # where')
    assert format_spec(_parse(out)) == out                         # idempotent
