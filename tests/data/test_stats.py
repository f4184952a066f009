"""Dataset statistics from the index, and their JSON as a spec's empirical file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dtdsl import cli
from dtdsl.data.shards import Dataset, write_dataset
from dtdsl.data.stats import measure, stats_json, stats_table, summarize
from dtdsl.data.synth import synthesize
from dtdsl.ir import program as ir

from .conftest import NUM_SAMPLES, TINY, check_spec


def test_measure_reads_the_index(tiny_dataset: Path):
    with Dataset.open(tiny_dataset) as ds:
        values = measure(ds, patch=8)
        infos = [ds.info(i) for i in range(len(ds))]
    assert list(values) == ["text.tokens", "image.count", "image.patches", "image.gen_count"]
    assert values["text.tokens"] == [s.text_tokens for s in infos]
    assert len(values["image.count"]) == len(values["image.gen_count"]) == NUM_SAMPLES
    assert len(values["image.patches"]) == sum(values["image.count"])
    assert values["image.patches"] == [w * h // 64 for s in infos for w, h in s.images]
    with Dataset.open(tiny_dataset) as ds:
        clamped = measure(ds, patch=8, max_patches=20)["image.patches"]
        assert max(clamped) <= 20 < max(values["image.patches"])
        assert measure(ds, patch=16)["image.patches"] != values["image.patches"]


def test_summarize():
    (s,) = summarize({"x": list(range(1, 101)), "empty": []})
    assert (s.name, s.count, s.mean, s.min, s.p50, s.p90, s.p99, s.max) == \
        ("x", 100, 50.5, 1, 50, 90, 99, 100)
    table = stats_table([s])
    assert [c.header for c in table.columns] == ["quantity", "count", "mean", "min", "p50",
                                                 "p90", "p99", "max"]


def test_audio_quantities(av, tmp_path: Path):
    write_dataset(tmp_path, synthesize(av, 50, seed=0))
    with Dataset.open(tmp_path) as ds:
        values = measure(ds, patch=8)
    assert set(values) == {"text.tokens", "image.count", "image.patches", "image.gen_count",
                           "audio.count", "audio.frames", "audio.gen_count"}
    assert all(16 <= f <= 48 for f in values["audio.frames"])


def test_text_only_dataset_lists_text_alone(tmp_path: Path):
    program = check_spec(TINY.read_text().replace("image.count     ~ zipf(a=2.0) clamp [0, 3]",
                                                  "image.count     ~ constant(0)").replace(
        "image.gen_count ~ choice([0, 1], p=[0.6, 0.4])", "image.gen_count ~ constant(0)"))
    write_dataset(tmp_path, synthesize(program, 20, seed=0))
    with Dataset.open(tmp_path) as ds:
        assert list(measure(ds)) == ["text.tokens"]


@pytest.mark.parametrize("key", ["text.tokens", "image.count", "image.patches",
                                 "image.gen_count"])
def test_stats_json_is_an_empirical_file_dtc_check_accepts(tiny_dataset: Path,
                                                           tmp_path: Path, key: str):
    with Dataset.open(tiny_dataset) as ds:
        values = measure(ds, patch=8)
    (tmp_path / "stats.json").write_text(stats_json(values))
    assert json.loads((tmp_path / "stats.json").read_text()) == values
    text = TINY.read_text()
    lines = [line for line in text.splitlines() if line.strip().startswith(key + " ")]
    assert len(lines) == 1
    spec = tmp_path / "measured.dt"
    spec.write_text(text.replace(lines[0], f'  {key} ~ empirical("stats.json")'))
    assert cli.main(["check", "-q", "--synthetic", str(spec)]) == 0
    program = check_spec(spec.read_text(), str(spec))
    quantity = program.data.get(*key.split("."))
    assert isinstance(quantity.dist, ir.Empirical)
    assert quantity.dist.values == tuple(float(v) for v in values[key])
    assert np.isclose(np.mean(quantity.dist.values), np.mean(values[key]))
