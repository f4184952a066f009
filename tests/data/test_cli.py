"""`dtc data synth` and `dtc data stats`, through ``register`` on a parser of their own."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from dtdsl.cli.common import Parser
from dtdsl.data.cli import DEFAULT_MAX_SAMPLES, _default_samples, register
from dtdsl.data.shards import Dataset
from dtdsl.errors import DtdslError

from .conftest import TINY


def dtc(*argv: str) -> int:
    """Parse and run like dtc's main (``dtdsl.cli.main``): errors in the input (a
    ``DtdslError``: usage, a dataset, a tokenizer) print once and exit with their code."""
    parser = Parser(prog="dtc")
    register(parser.add_subparsers(dest="command", parser_class=Parser))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except DtdslError as err:
        print(f"dtc: error: {err}", file=sys.stderr)
        return err.exit_code


def _spec(tmp_path: Path, source: str | None = 'source = "data/tiny"',
          samples: str = "") -> Path:
    text = TINY.read_text().replace('source = "data/tiny"', (source or "") + samples)
    path = tmp_path / "specs" / "tiny.dt"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    return path


def test_synth_writes_to_the_spec_source(tmp_path: Path, capsys):
    spec = _spec(tmp_path)
    assert dtc("data", "synth", str(spec), "--samples", "30", "--shard-size", "8") == 0
    err = capsys.readouterr().err
    out = tmp_path / "specs" / "data" / "tiny"    # relative to the spec's folder
    assert f"wrote 30 samples of tiny_cpu (seed 1234) to {out}: 4 shards" in err
    with Dataset.open(out) as ds:
        assert len(ds) == 30 and ds.provenance["seed"] == 1234
        first = ds.read(0)
    assert dtc("data", "synth", str(spec), "-o", str(tmp_path / "o"), "--samples", "3",
               "--seed", "1234", "-q") == 0
    assert capsys.readouterr().err == ""
    with Dataset.open(tmp_path / "o") as ds:
        assert ds.read(0) == first


def test_synth_refuses_a_non_empty_directory(tmp_path: Path, capsys):
    spec = _spec(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "x.txt").write_text("mine")
    for extra in ((), ("--overwrite",)):    # someone's files: never written into
        assert dtc("data", "synth", str(spec), "-o", str(out), "--samples", "2", *extra) == 2
        assert f"{out} holds files dtdsl did not write (x.txt)" in capsys.readouterr().err
    (out / "x.txt").unlink()
    assert dtc("data", "synth", str(spec), "-o", str(out), "--samples", "2", "-q") == 0
    assert dtc("data", "synth", str(spec), "-o", str(out), "--samples", "2") == 2
    assert f"{out} holds a dataset: pass --overwrite to replace it" in capsys.readouterr().err
    assert dtc("data", "synth", str(spec), "-o", str(out), "--samples", "2", "--overwrite",
               "-q") == 0
    assert sorted(p.name for p in out.iterdir()) == ["index.json", "shard-000000.tar"]
    # Beside our dataset, a file it does not list (one with the name of a shard the new
    # dataset would write): refused, overwrite or not, and it stays as it was.
    (out / "shard-000001.tar").write_bytes(b"someone's shard")
    for extra in ((), ("--overwrite",)):
        assert dtc("data", "synth", str(spec), "-o", str(out), "--samples", "20",
                   "--shard-size", "4", *extra) == 2
        assert f"{out} holds files dtdsl did not write (shard-000001.tar)" in \
            capsys.readouterr().err
    assert (out / "shard-000001.tar").read_bytes() == b"someone's shard"
    with Dataset.open(out) as ds:
        assert len(ds) == 2
    (tmp_path / "file").write_text("")
    assert dtc("data", "synth", str(spec), "-o", str(tmp_path / "file")) == 2
    assert "exists and is not a directory" in capsys.readouterr().err


@pytest.mark.parametrize("source, message", [
    (None, "has no data.source; give the output directory with -o DIR"),
    ('source = "shards/{000000..000009}.tar"', "names shard files, not a directory"),
])
def test_synth_needs_an_output_directory(tmp_path: Path, capsys, source, message):
    assert dtc("data", "synth", str(_spec(tmp_path, source))) == 2
    assert message in capsys.readouterr().err


def test_synth_errors(tmp_path: Path, capsys):
    bad = tmp_path / "bad.dt"
    bad.write_text("spec x\ntrain { global_batch = 0 }\n")
    assert dtc("data", "synth", str(bad), "-o", str(tmp_path / "o")) == 1
    assert "error[" in capsys.readouterr().err
    assert dtc("data", "synth", str(tmp_path / "missing.dt")) == 2
    assert "no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        dtc("data", "synth", str(TINY), "--samples", "0")
    assert exit_.value.code == 2
    with pytest.raises(SystemExit):
        dtc("data")
    assert "required: COMMAND" in capsys.readouterr().err


def test_default_sample_count(tiny, tmp_path: Path):
    assert _default_samples(tiny) == min(4 * 16 * 20, DEFAULT_MAX_SAMPLES) == 1280
    big = tiny.model_copy(update={"train": tiny.train.model_copy(update={"steps": 10**6})})
    assert _default_samples(big) == DEFAULT_MAX_SAMPLES
    spec = _spec(tmp_path, 'source = "d"', "\n  samples = 7")
    assert dtc("data", "synth", str(spec), "-q") == 0
    with Dataset.open(spec.parent / "d") as ds:
        assert len(ds) == 7


def test_stats(tiny_dataset: Path, tmp_path: Path, capsys):
    assert dtc("data", "stats", str(tiny_dataset), "--spec", str(TINY)) == 0
    out = capsys.readouterr().out
    assert "2,000 samples in 4 shards (image patches of 8 px; " in out
    assert "text.tokens" in out and "image.patches" in out and "p99" in out
    assert dtc("data", "stats", str(tiny_dataset), "--json", "--patch", "8", "-o",
               str(tmp_path / "s.json")) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads((tmp_path / "s.json").read_text())
    assert len(printed["text.tokens"]) == 2000
    assert dtc("data", "stats", str(tiny_dataset), "--json") == 0   # patch 14 by default
    assert json.loads(capsys.readouterr().out)["image.patches"] != printed["image.patches"]


def test_stats_errors(tmp_path: Path, tiny_dataset: Path, capsys):
    assert dtc("data", "stats", str(tmp_path)) == 2
    assert f"{tmp_path} holds no dataset: no dtdsl index and no .tar shards" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        dtc("data", "stats", str(tiny_dataset), "--spec", str(TINY), "--patch", "8")
    assert "not allowed with argument" in capsys.readouterr().err
    assert dtc("data", "stats", str(tiny_dataset), "--json", "-o", str(tmp_path)) == 2
    assert "is a directory" in capsys.readouterr().err
    # Its own earlier JSON is replaced; a file it did not write is not.
    (tmp_path / "mine.json").write_text('{"notes": "mine"}')
    assert dtc("data", "stats", str(tiny_dataset), "--json", "-o",
               str(tmp_path / "mine.json")) == 2
    assert "is not a stats JSON dtdsl wrote" in capsys.readouterr().err
    assert (tmp_path / "mine.json").read_text() == '{"notes": "mine"}'
    for _ in range(2):
        assert dtc("data", "stats", str(tiny_dataset), "--json", "-o",
                   str(tmp_path / "s.json")) == 0


def test_a_spec_given_as_the_dataset_says_so(capsys):
    # It read as a truncated tar.
    for command in ("stats", "index"):
        assert dtc("data", command, str(TINY)) == 2
        assert f"{TINY} is a spec, not a dataset" in capsys.readouterr().err
