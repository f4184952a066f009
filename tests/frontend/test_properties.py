"""Property tests: the front end only ever answers with diagnostics, and fmt keeps meaning.

Inputs come from the grammar itself (hypothesis' lark strategy) and from byte-level
mutations of the shipped specs.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.lark import from_lark
from lark import Lark

from dtdsl.driver import run_frontend
from dtdsl.frontend.ast import strip_spans
from dtdsl.frontend.fmt import format_spec
from dtdsl.frontend.parser import UNITS, parse
from dtdsl.resources import grammar_text
from dtdsl.source import Source

ROOT = Path(__file__).resolve().parents[2]
SPECS = {p.name: p.read_bytes() for p in sorted((ROOT / "specs").glob("*.dt"))}
KEYWORDS = {"spec", "model", "data", "cluster", "train", "constraints", "encoder", "backbone",
            "generator", "projector", "clamp", "in", "true", "false"}
# DTDSL_PROPERTY_EXAMPLES=5000 for a longer soak than CI's default.
PROPERTY_SETTINGS = settings(max_examples=int(os.environ.get("DTDSL_PROPERTY_EXAMPLES", 150)),
                             deadline=None, suppress_health_check=list(HealthCheck))

# Terminals are padded with spaces: hypothesis joins tokens without the whitespace the
# grammar ignores, and "spec" + "x" must not become "specx".
_names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True).filter(
    lambda n: n not in KEYWORDS and n not in UNITS)
_numbers = st.builds(lambda n, u: f"{n}{u}", st.one_of(
    st.integers(0, 10**9).map(str), st.floats(0, 1e6, allow_nan=False).map(lambda f: f"{f:.3f}")),
    st.sampled_from([""] + [" " + u for u in UNITS]))
_strings = st.text(st.characters(codec="ascii", exclude_characters='"\\\n\r'),
                   max_size=12).map(lambda s: f'"{s}"')
_LARK = Lark(grammar_text(), parser="lalr", lexer="contextual")
_KEYWORD_TERMINALS = {t.name: st.just(f" {t.pattern.value} ") for t in _LARK.terminals
                      if t.pattern.type == "str" and t.pattern.value.isidentifier()}
GRAMMAR_SPECS = from_lark(_LARK, explicit={
    "NAME": _names.map(lambda n: f" {n} "), "NUMBER": _numbers.map(lambda n: f" {n} "),
    "STRING": _strings, "COMMENT": st.just(" # note\n"), "SCHED_1F1B": st.just(" 1f1b "),
    "WS": st.just(" "), **_KEYWORD_TERMINALS})


def _assert_only_diagnostics(name: str, data: bytes) -> None:
    """Never an exception; every diagnostic points inside the file."""
    result = run_frontend(name, data, base_dir=ROOT / "specs")
    lines = data.count(b"\n") + 1
    for diag in result.diagnostics:
        assert 1 <= diag.span.line <= lines + 1, diag
        assert diag.span.column >= 1, diag
        assert diag.code.startswith("DT") and diag.message


def _comments(text: str) -> Counter:
    """The spec's comments, as fmt keeps them (its lines lose trailing whitespace)."""
    spec = parse(Source(name="x", text=text)).spec
    return Counter(c.text.rstrip() for c in spec.comments)


def _assert_fmt_round_trip(text: str) -> None:
    parsed = parse(Source(name="x", text=text))
    assert parsed.spec is not None
    once = format_spec(parsed.spec)
    again = parse(Source(name="x", text=once))
    assert again.spec is not None, again.diagnostics
    assert strip_spans(again.spec) == strip_spans(parsed.spec)
    assert format_spec(again.spec) == once
    assert _comments(once) == _comments(text)


@PROPERTY_SETTINGS
@given(GRAMMAR_SPECS)
def test_grammar_generated_specs_parse_and_check(text: str):
    parsed = parse(Source(name="gen.dt", text=text))
    # Text produced from the grammar is grammatical; anything else is a lexer/grammar bug.
    assert parsed.spec is not None, parsed.diagnostics
    _assert_only_diagnostics("gen.dt", text.encode())


@PROPERTY_SETTINGS
@given(GRAMMAR_SPECS)
def test_fmt_round_trips_grammar_generated_specs(text: str):
    _assert_fmt_round_trip(text)


_mutation = st.tuples(st.sampled_from(["insert", "delete", "replace", "dup_line", "drop_line"]),
                      st.integers(0, 1 << 30), st.binary(min_size=1, max_size=4))


def _mutate(data: bytes, mutations) -> bytes:
    for kind, where, payload in mutations:
        if kind in ("dup_line", "drop_line"):
            lines = data.split(b"\n")
            i = where % len(lines)
            lines[i:i + 1] = [lines[i]] * 2 if kind == "dup_line" else []
            data = b"\n".join(lines)
            continue
        i = where % (len(data) + 1)
        if kind == "insert":
            data = data[:i] + payload + data[i:]
        elif kind == "delete":
            data = data[:i] + data[i + len(payload):]
        else:
            data = data[:i] + payload + data[i + len(payload):]
    return data


@PROPERTY_SETTINGS
@given(st.sampled_from(sorted(SPECS)), st.lists(_mutation, min_size=1, max_size=6))
def test_mutated_specs_only_produce_diagnostics(name: str, mutations):
    data = _mutate(SPECS[name], mutations)
    _assert_only_diagnostics(name, data)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return
    if "\0" not in text and parse(Source(name=name, text=text)).spec is not None:
        _assert_fmt_round_trip(text)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_fmt_round_trips_shipped_specs(name: str):
    text = SPECS[name].decode()
    _assert_fmt_round_trip(text)
    assert format_spec(parse(Source(name=name, text=text)).spec) == text, \
        f"specs/{name} is not in canonical layout: run dtc fmt specs/{name}"
