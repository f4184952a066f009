"""WebDataset shards written by the ``webdataset`` package, read directly: grouping by key,
the index (built once, cached, rebuilt when a shard changes), damaged data counted and
skipped, sources that cannot be read refused; a tiny bundle trains on them."""

from __future__ import annotations

import io
import os
import tarfile

import pytest

from dtdsl import cli
from dtdsl.data.shards import DatasetError
from dtdsl.data.sources import open_dataset, source_problem
from dtdsl.data.webdataset import WebDataset, build_index, expand_source, resolve_shards
from tests.helpers.media import (
    write_shards,
)
from tests.text_models import make_tokenizer


def test_brace_patterns_expand_like_webdatasets():
    assert expand_source("a/{000..002}.tar") == ["a/000.tar", "a/001.tar", "a/002.tar"]
    assert expand_source("{x,y}/{8..10}") == ["x/8", "x/9", "x/10", "y/8", "y/9", "y/10"]
    assert expand_source("plain.tar") == ["plain.tar"]
    with pytest.raises(ValueError, match="runs backwards"):
        expand_source("{5..1}")
    # Counted before any name is made: 1e10 names in all, each range well under the bound.
    for pattern in ("s/{0..99999}/{0..99999}.tar", "{a,b}/{0..9999999}"):
        with pytest.raises(ValueError, match="names more than 10,000,000 files"):
            expand_source(pattern)


def test_samples_are_grouped_by_key_with_their_sizes(tmp_path):
    keys = write_shards(tmp_path / "s", n=12, per_shard=5)
    ds = WebDataset.open("s/{000000..000002}.tar", base_dir=tmp_path)
    assert len(ds) == 12 and [ds.key(i) for i in range(12)] == keys
    info = ds.info(1)
    assert info.images == ((64, 64),) and info.gen_images == ()
    assert ds.info(3).gen_images == ((32, 32),)        # its gen.jpg: an image to generate
    raw = ds.read(3)
    assert raw.text.startswith("word") and raw.meta == {"source": "test", "i": 3}
    assert [(im.format, im.width, im.height) for im in raw.images] == [("jpeg", 32, 32)]
    assert len(raw.gen_images) == 1
    # The same through a folder, and with the images as targets (a text-to-image model).
    targets = WebDataset.open(tmp_path / "s", image_role="target")
    assert targets.info(1).images == () and targets.info(1).gen_images == ((64, 64),)
    with pytest.raises(DatasetError, match="no such file"):
        resolve_shards("s/{000000..000009}.tar", tmp_path)


def test_the_index_is_built_once_and_rebuilt_when_a_shard_changes(tmp_path):
    write_shards(tmp_path / "s", n=12, per_shard=5)
    shards = resolve_shards(str(tmp_path / "s"))
    first = build_index(shards)
    assert first.path is not None and first.path.parent == tmp_path / "s" / ".dtdsl-index"
    again = build_index(shards)
    assert again.path == first.path and again.samples == first.samples
    # A shard rewritten: another fingerprint, another index.
    write_shards(tmp_path / "s", n=12, per_shard=5, seed=9)
    os.utime(shards[0], ns=(1, 1))
    changed = build_index(shards)
    assert changed.path != first.path and changed.samples != first.samples


def test_damaged_samples_are_counted_and_skipped(tmp_path):
    root = tmp_path / "s"
    write_shards(root, n=10, per_shard=10)
    # A corrupt JPEG and an empty caption in a second shard, and a third cut in half.
    with tarfile.open(root / "000001.tar", "w") as tar:
        for name, data in (("bad.jpg", b"not a jpeg"), ("bad.txt", b"a caption"),
                           ("empty.txt", b"   "), ("notext.json", b"{}")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    write_shards(tmp_path / "t", n=6, per_shard=6, seed=3)
    whole = (tmp_path / "t" / "000000.tar").read_bytes()
    (root / "000002.tar").write_bytes(whole[:len(whole) // 2])
    ds = WebDataset.open(root)
    assert ds.skipped == {"unreadable image": 1, "empty text": 1, "no text": 1,
                          "cut off (truncated tar)": 1}
    assert 10 < len(ds) < 16                             # the truncated shard's first samples
    for i in range(len(ds)):
        ds.read(i)


def _png(w: int, h: int, fmt: str = "PNG") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), (w, h, 7)).save(buf, fmt)
    return buf.getvalue()


def test_images_keep_their_names_numeric_order_and_other_members_are_counted(tmp_path):
    # webdataset's TarWriter stores a sample's members sorted as text (10 before 2); the
    # <image> tags go with the images in their numbers' order. A format not read (gif)
    # and a member written twice skip their sample, counted, instead of training it as
    # text alone or with the second copy twice.
    import webdataset as wds

    root = tmp_path / "s"
    root.mkdir()
    with wds.TarWriter(str(root / "000000.tar")) as sink:
        sink.write({"__key__": "many", "txt": "eleven images",
                    **{f"{i}.png": _png(10 + i, 4) for i in range(11)}})
        sink.write({"__key__": "gif", "txt": "a gif", "gif": _png(8, 8, "GIF")})
    with tarfile.open(root / "000000.tar", "a") as tar:
        for name, data in (("twice.png", _png(40, 30)), ("twice.png", _png(4000, 1)),
                           ("twice.txt", b"two of one name")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    ds = WebDataset.open(root)
    assert [ds.key(i) for i in range(len(ds))] == ["many"]
    assert ds.info(0).images == tuple((10 + i, 4) for i in range(11))
    assert [im.width for im in ds.read(0).images] == [10 + i for i in range(11)]
    assert ds.skipped == {"gif image (jpg, png and webp are read)": 1,
                          "member repeated in a sample": 1}


def test_sources_that_cannot_be_read_say_why(tmp_path):
    assert "no such file" in source_problem("missing/{0..3}.tar", tmp_path)
    (tmp_path / "empty").mkdir()
    assert "holds no dataset" in source_problem("empty", tmp_path)
    (tmp_path / "junk.tar").write_bytes(b"x" * 2000)
    assert "not a readable tar" in source_problem("junk.tar", tmp_path)
    write_shards(tmp_path / "ok", n=3)
    assert source_problem("ok", tmp_path) is None
    with open_dataset("ok", base_dir=tmp_path) as ds:
        assert len(ds) == 3


def test_data_stats_and_index_read_webdataset_shards(tmp_path, capsys):
    write_shards(tmp_path / "s", n=12, per_shard=5)
    pattern = str(tmp_path / "s" / "{000000..000002}.tar")
    assert cli.main(["data", "index", pattern]) == 0
    assert "12 samples in 3 shards" in capsys.readouterr().err
    assert cli.main(["data", "stats", pattern, "--patch", "8", "--json"]) == 0
    import json

    stats = json.loads(capsys.readouterr().out)
    assert stats["image.count"] == [1] * 12
    assert sorted(set(stats["image.patches"])) == [16, 30, 64]    # 32x32, 48x40, 64x64 at 8 px
    assert stats["image.gen_count"] == [1 if i % 3 == 0 else 0 for i in range(12)]


@pytest.mark.slow
def test_a_bundle_trains_on_webdataset_shards_and_consumes_each_key_once(tmp_path):
    from tests.helpers.bundle import (
        SPEC,
        consumed,
        launch_ok,
        on_two_ranks,
        read_jsonl,
        reference_losses,
        worker_log,
    )

    keys = write_shards(tmp_path / "shards", n=48, per_shard=10)
    make_tokenizer(tmp_path / "tok")
    spec = tmp_path / "tiny.dt"
    # On 2 ranks (tiny_cpu's layout at DP 2, both launches): the claims are the workers'
    # reading of the shards, whatever the replicas they feed.
    spec.write_text(on_two_ranks(SPEC.read_text()).replace(
        'source = "data/tiny"', 'source = "shards/{000000..000004}.tar"\n  tokenizer = "tok"'))
    bundle = tmp_path / "bundle"
    assert cli.main(["compile", str(spec), "-o", str(bundle), "--workers", "2"]) == 0
    run_dir = tmp_path / "run"
    launch_ok(bundle, run_dir, "--steps", "4")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    # one sample per sequence (no packing), none longer than seq_len
    assert all(m["documents"] == 16 and m["cut_samples"] == 0 for m in metrics)
    want = reference_losses(4, tmp_path / "shards" / "{000000..000004}.tar", spec)
    assert [m["loss"] for m in metrics] == pytest.approx(want, rel=1e-4)
    for unit in ("vit", "llm", "gen"):
        per_step = consumed(run_dir, unit)
        assert sorted(k for step in range(3) for k in per_step[step]) == keys, unit
    # Three workers, worker 0 killed at its second step (3) and restarted: the same
    # batches and losses (one launch for both: a launch is mostly starting processes).
    three = tmp_path / "three"
    assert cli.main(["compile", str(spec), "-o", str(three), "--workers", "3"]) == 0
    killed = tmp_path / "killed"
    launch_ok(three, killed, "--steps", "4", env={"DTDSL_FAULT": "worker0@3"})
    log = worker_log(killed)
    assert "killing worker0 at step 3" in log and "restarting it" in log
    assert "worker 2: step 2 sent" in log
    assert read_jsonl(killed / "samples.jsonl") == read_jsonl(run_dir / "samples.jsonl")
    assert [m["loss"] for m in read_jsonl(killed / "metrics.jsonl")] == pytest.approx(
        [m["loss"] for m in metrics], rel=1e-6)


def test_real_text_needs_a_tokenizer_and_stats_count_with_it(tmp_path, capsys):
    """Shards hold real text: without a tokenizer dtc check says so at the source line
    (the hashing tokenizer is for synthetic data only); dtc data stats counts text.tokens
    with the tokenizer given, BOS and EOS included."""
    from tests.helpers.bundle import SPEC

    write_shards(tmp_path / "shards", n=6, per_shard=3)
    spec = tmp_path / "tiny.dt"
    spec.write_text(SPEC.read_text().replace('source = "data/tiny"', 'source = "shards"'))
    assert cli.main(["check", str(spec)]) == 1
    err = capsys.readouterr().err
    assert "error[DT315]: data source 'shards' is real text, which needs a tokenizer" in err
    make_tokenizer(tmp_path / "tok")
    spec.write_text(spec.read_text().replace('source = "shards"',
                                             'source = "shards"\n  tokenizer = "tok"'))
    assert cli.main(["check", str(spec)]) == 0
    capsys.readouterr()
    assert cli.main(["data", "stats", str(tmp_path / "shards"), "--tokenizer",
                     str(tmp_path / "tok"), "--json"]) == 0
    stats = __import__("json").loads(capsys.readouterr().out)
    from transformers import PreTrainedTokenizerFast

    theirs = PreTrainedTokenizerFast.from_pretrained(str(tmp_path / "tok"))
    with open_dataset("shards", base_dir=tmp_path) as ds:
        texts = [ds.read(i).text for i in range(len(ds))]
    assert stats["text.tokens"] == [len(theirs(t)["input_ids"]) + 1 for t in texts]


def test_a_compressed_shard_says_so(tmp_path, capsys):
    # webdataset streams .tar.gz; dtdsl reads each sample in place, from a plain tar.
    import gzip

    write_shards(tmp_path / "s", n=4, per_shard=4)
    (tmp_path / "z").mkdir()
    (tmp_path / "z" / "000000.tar").write_bytes(
        gzip.compress((tmp_path / "s" / "000000.tar").read_bytes()))
    want = f"{tmp_path / 'z' / '000000.tar'} is gzip-compressed: dtdsl reads plain tar shards"
    assert want in source_problem(str(tmp_path / "z"), tmp_path)
    with pytest.raises(DatasetError, match="is gzip-compressed"):
        WebDataset.open(tmp_path / "z")
    assert cli.main(["data", "index", str(tmp_path / "z")]) == 2
    assert want in capsys.readouterr().err
    # A plain tar whose first member's name starts as bzip2's magic ("BZh") is a tar.
    (tmp_path / "t").mkdir()
    with tarfile.open(tmp_path / "t" / "000000.tar", "w") as tar:
        info = tarfile.TarInfo("BZh91.txt")
        info.size = 9
        tar.addfile(info, io.BytesIO(b"a caption"))
    assert source_problem(str(tmp_path / "t"), tmp_path) is None
    assert len(WebDataset.open(tmp_path / "t")) == 1
