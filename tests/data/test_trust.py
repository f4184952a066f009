"""Data nobody should trust: paths that leave their folder, FIFOs, truncated tars, sources
with nothing to train on, samples outside the spec's clamps, images whose header reads
but whose body does not decode. Each is refused or counted, never read, waited on or
trained on silently."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dtdsl import cli
from dtdsl.data.llava import build_index as llava_index
from dtdsl.data.shards import Dataset, DatasetError, NoSamples, write_dataset
from dtdsl.data.sources import open_dataset, source_problem
from dtdsl.data.webdataset import CUT_OFF, WebDataset
from dtdsl.driver import run_frontend
from tests.helpers.media import (
    corrupt_dataset,
    image_samples,
    write_shards,
)
from tests.text_models import make_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "specs" / "tiny_cpu.dt"
PROPERTY = settings(max_examples=int(os.environ.get("DTDSL_PROPERTY_EXAMPLES", 25)),
                    deadline=None, suppress_health_check=list(HealthCheck))
TIMEOUT_S = 30.0


def _image(rng: np.random.Generator, w: int, h: int, fmt: str = "JPEG") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, fmt)
    return buf.getvalue()


def _turns(placeholders: int = 1, answer: str = "A dog runs in the park.") -> list[dict]:
    return [{"from": "human", "value": "<image>\n" * placeholders + "What is in the image?"},
            {"from": "gpt", "value": answer}]


def _finishes(fn: Callable[[], Any], timeout_s: float = TIMEOUT_S) -> Any:
    """``fn()``'s result (or its exception, raised here), failing the test when it has not
    returned within ``timeout_s`` (a FIFO opened for reading blocks forever)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - handed to the test's thread
            out["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"blocked for {timeout_s} s (a FIFO opened?)"
    if "error" in out:
        raise out["error"]
    return out["value"]


# ---- paths stay in their folders ------------------------------------------------------------

# How a LLaVA record may name its image, and what the index must make of it (None: taken).
OUTSIDE, ABSOLUTE, NOT_REGULAR = ("image path refused (outside its folder)",
                                  "image path refused (absolute path)",
                                  "image path refused (not a regular file)")
KINDS = {
    "plain": None, "nested": None, "dotdot_inside": None, "symlink_inside": None,
    "dotdot_out": OUTSIDE, "deep_out": OUTSIDE, "symlink_out": OUTSIDE,
    "dir_symlink_out": OUTSIDE, "absolute_out": ABSOLUTE, "absolute_in": ABSOLUTE,
    "fifo": NOT_REGULAR, "directory": NOT_REGULAR, "missing": "missing image",
}


def _name(kind: str, k: int, root: Path, rng: np.random.Generator) -> str:
    """Make the file a record of ``kind`` names (k: a unique number) and return the name."""
    folder, outside = root / "images", root / "outside"
    jpeg = _image(rng, 16 + 8 * (k % 3), 16)
    (outside / f"{k}.jpg").write_bytes(jpeg)        # what an escape would reach
    if kind in ("plain", "dotdot_inside", "absolute_in"):
        (folder / f"{k}.jpg").write_bytes(jpeg)
    return {
        "plain": f"{k}.jpg",
        "nested": _nested(folder, k, jpeg),
        "dotdot_inside": f"sub/../{k}.jpg",
        "symlink_inside": _link(folder / f"link{k}.jpg", _nested(folder, k, jpeg), folder),
        "dotdot_out": f"../outside/{k}.jpg",
        "deep_out": f"sub/../../outside/{k}.jpg",
        "symlink_out": _link(folder / f"out{k}.jpg", outside / f"{k}.jpg"),
        "dir_symlink_out": _link(folder / f"dir{k}", outside) + f"/{k}.jpg",
        "absolute_out": str(outside / f"{k}.jpg"),
        "absolute_in": str(folder / f"{k}.jpg"),
        "fifo": _fifo(folder / f"fifo{k}.jpg"),
        "directory": _dir(folder / f"dir{k}.jpg"),
        "missing": f"gone{k}.jpg",
    }[kind]


def _nested(folder: Path, k: int, data: bytes) -> str:
    (folder / "sub").mkdir(exist_ok=True)
    (folder / "sub" / f"{k}.jpg").write_bytes(data)
    return f"sub/{k}.jpg"


def _link(link: Path, target: Path | str, base: Path | None = None) -> str:
    os.symlink(base / target if base is not None else target, link)
    return link.name


def _fifo(path: Path) -> str:
    os.mkfifo(path)
    return path.name


def _dir(path: Path) -> str:
    path.mkdir()
    return path.name


def _llava(root: Path, kinds: list[str]) -> list[str]:
    """A LLaVA JSON of one record per kind; the ids of those the index must take."""
    rng = np.random.default_rng(len(kinds))
    for d in ("images", "outside"):
        (root / d).mkdir(parents=True, exist_ok=True)
    records, good = [], []
    for k, kind in enumerate(kinds):
        records.append({"id": f"r{k}", "image": _name(kind, k, root, rng),
                        "conversations": _turns()})
        if KINDS[kind] is None:
            good.append(f"r{k}")
    (root / "llava.json").write_text(json.dumps(records))
    return good


@PROPERTY
@given(st.lists(st.sampled_from(sorted(KINDS)), min_size=1, max_size=12))
def test_llava_image_paths_stay_in_the_image_folder(kinds):
    """Whatever a record names, the index takes exactly the images inside the folder that
    are regular files and counts the others by reason, without ever blocking; reading a
    sample checks its paths again."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        good = _llava(root, kinds)
        index = _finishes(lambda: llava_index(root / "llava.json", root / "images"))
        assert [s["key"] for s in index.samples] == good
        want: dict[str, int] = {}
        for kind in kinds:
            if KINDS[kind] is not None:
                want[KINDS[kind]] = want.get(KINDS[kind], 0) + 1
        assert dict(index.skipped) == want
        if not good:
            return
        # An image swapped for a symlink out of the folder after indexing is not read.
        with open_dataset(str(root / "llava.json"), image_folder=root / "images") as ds:
            name = index.samples[0]["images"][0][0]
            target = root / "images" / name
            target.unlink()
            os.symlink(root / "outside" / "0.jpg", target)
            with pytest.raises(DatasetError, match="leads out of"):
                ds.read(0)


def test_refused_paths_are_counted_by_data_index_and_stats(tmp_path, capsys):
    _llava(tmp_path, ["plain", "dotdot_out", "absolute_out", "symlink_out", "fifo"])
    source = str(tmp_path / "llava.json")
    folder = str(tmp_path / "images")
    assert _finishes(lambda: cli.main(["data", "index", source, "--image-folder", folder])) == 0
    err = capsys.readouterr().err
    assert "1 samples" in err and f"2 ({OUTSIDE})" in err and f"1 ({ABSOLUTE})" in err
    assert f"1 ({NOT_REGULAR})" in err
    assert cli.main(["data", "stats", source, "--image-folder", folder, "--json"]) == 0
    assert f"2 ({OUTSIDE})" not in capsys.readouterr().err       # JSON only: no title
    assert cli.main(["data", "stats", source, "--image-folder", folder]) == 0
    assert f"2 ({OUTSIDE})" in capsys.readouterr().out.replace("\n", " ")


def _tar(path: Path, rng: np.random.Generator, n: int = 3) -> None:
    """A WebDataset tar of ``n`` samples at ``path``."""
    write_shards(path.parent / f".{path.stem}", n=n, per_shard=n, seed=int(rng.integers(99)))
    os.replace(path.parent / f".{path.stem}" / "000000.tar", path)


def test_webdataset_shards_stay_in_their_folder(tmp_path):
    """A folder's or a pattern's shards: a symlink out of the folder and a FIFO are refused
    and counted; a symlink to a tar inside the folder is read; with nothing left the source
    is NoSamples."""
    rng = np.random.default_rng(1)
    shards, outside = tmp_path / "shards", tmp_path / "outside"
    (shards / "deep").mkdir(parents=True)
    outside.mkdir()
    _tar(shards / "000000.tar", rng)
    _tar(shards / "deep" / "real.tar", rng)
    os.symlink(shards / "deep" / "real.tar", shards / "000001.tar")
    _tar(outside / "x.tar", rng)
    os.symlink(outside / "x.tar", shards / "000002.tar")
    os.mkfifo(shards / "000003.tar")
    for source in (str(shards), str(shards / "{000000..000003}.tar")):
        ds = _finishes(lambda source=source: open_dataset(source, base_dir=tmp_path))
        assert len(ds) == 6 and len(ds.refused) == 2
        assert any("leads out of" in p for p in ds.problems)
        assert any("a FIFO" in p for p in ds.problems)
    # A pattern whose alternatives leave its folder.
    ds = open_dataset("shards/{000000,../outside/x}.tar", base_dir=tmp_path)
    assert len(ds) == 3 and len(ds.refused) == 1
    only_bad = tmp_path / "bad"
    only_bad.mkdir()
    os.symlink(outside / "x.tar", only_bad / "a.tar")
    os.mkfifo(only_bad / "b.tar")
    with pytest.raises(NoSamples, match="every shard is refused"):
        _finishes(lambda: open_dataset(str(only_bad)))
    assert "refused" in _finishes(lambda: source_problem(str(only_bad)))


def test_a_dataset_index_reads_only_shards_inside_its_folder(tmp_path, tiny):
    from dtdsl.data.synth import synthesize

    data = tmp_path / "d"
    write_dataset(data, synthesize(tiny, 9, seed=2), samples_per_shard=3)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    os.replace(data / "shard-000001.tar", outside / "shard-000001.tar")
    os.symlink(outside / "shard-000001.tar", data / "shard-000001.tar")
    os.rename(data / "shard-000002.tar", tmp_path / "moved.tar")
    os.mkfifo(data / "shard-000002.tar")
    ds = _finishes(lambda: Dataset.open(data))
    assert [ds.key(i) for i in range(len(ds))] == ["00000000", "00000001", "00000002"]
    assert dict(ds.skipped) == {"shard refused": 6}
    assert len(ds.problems) == 2
    assert len(list(ds)) == 3
    os.unlink(data / "shard-000000.tar")
    os.symlink(outside / "shard-000001.tar", data / "shard-000000.tar")
    assert len(_finishes(lambda: Dataset.open(data))) == 0


def test_a_fifo_named_as_the_source_does_not_block(tmp_path):
    os.mkfifo(tmp_path / "llava.json")
    assert "FIFO" in _finishes(lambda: source_problem("llava.json", tmp_path))
    with pytest.raises(DatasetError, match="FIFO"):
        _finishes(lambda: open_dataset("llava.json", base_dir=tmp_path))
    os.mkfifo(tmp_path / "one.tar")
    assert "refused" in _finishes(lambda: source_problem("one.tar", tmp_path))
    (tmp_path / "d").mkdir()
    os.mkfifo(tmp_path / "d" / "index.json")
    with pytest.raises(DatasetError):
        _finishes(lambda: Dataset.open(tmp_path / "d"))


# ---- truncated tars ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def whole_tar(tmp_path_factory) -> tuple[bytes, list[tuple[str, int]]]:
    """A WebDataset tar of 6 samples (PAX headers, as webdataset writes them) and each
    member's (key, offset of its data)."""
    root = tmp_path_factory.mktemp("tar")
    write_shards(root, n=6, per_shard=6)
    data = (root / "000000.tar").read_bytes()
    with tarfile.open(root / "000000.tar") as tar:
        members = [(m.name.split(".")[0], m.offset, m.offset_data, m.size)
                   for m in tar.getmembers()]
    return data, members


def _expected(members: list, cut: int) -> list[str]:
    """The keys a tar cut at byte ``cut`` keeps: every sample whose next sample's first
    member has its headers whole before the cut (the sample read at the cut may lack
    members); all of them when the end-of-archive block is there."""
    keys = list(dict.fromkeys(k for k, *_ in members))
    end = max(off + -(-n // 512) * 512 for _, _, off, n in members)
    if cut >= end + 512:
        return keys
    first = {}
    for k, _, offset_data, _ in members:
        first.setdefault(k, offset_data)
    return [k for k, nxt in zip(keys, keys[1:], strict=False) if first[nxt] <= cut]


@PROPERTY
@given(st.data())
def test_a_truncated_tar_is_counted_and_its_whole_samples_used(whole_tar, data):
    """Cut anywhere (at a header boundary, inside a header, inside a member): the samples
    before the cut are read as they were, the shard is named as truncated and the sample
    at the cut counted; a tar with its end-of-archive block is whole."""
    whole, members = whole_tar
    boundaries = sorted({m[1] for m in members} | {m[2] for m in members})
    cut = data.draw(st.one_of(st.sampled_from(boundaries), st.integers(0, len(whole))))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "w").mkdir()
        (root / "w" / "000000.tar").write_bytes(whole)
        (root / "c").mkdir()
        (root / "c" / "000000.tar").write_bytes(whole[:cut])
        full = WebDataset.open(root / "w")
        ds = WebDataset.open(root / "c")
        want = _expected(members, cut)
        assert [ds.key(i) for i in range(len(ds))] == want
        if len(want) == len(full):
            assert not ds.problems and not ds.skipped
        else:
            assert dict(ds.skipped) == {CUT_OFF: 1}
            assert len(ds.problems) == 1 and ds.problems[0].startswith("000000.tar is truncated")
        by_key = {full.key(i): full.read(i) for i in range(len(full))}
        for i in range(len(ds)):
            assert ds.read(i) == by_key[ds.key(i)]


def test_data_index_and_check_report_a_truncated_tar(tmp_path, capsys):
    write_shards(tmp_path / "shards", n=30, per_shard=10)
    shard = tmp_path / "shards" / "000001.tar"
    whole = shard.read_bytes()
    with tarfile.open(shard) as tar:
        boundary = tar.getmembers()[12].offset           # a header boundary, mid-shard
    shard.write_bytes(whole[:boundary])
    assert cli.main(["data", "index", str(tmp_path / "shards")]) == 0
    err = capsys.readouterr().err
    assert "000001.tar is truncated: it ends at byte" in err and "a header boundary" in err
    assert f"1 ({CUT_OFF})" in err
    spec = _real_spec(tmp_path, 'source = "shards"')
    assert cli.main(["check", str(spec)]) == 0
    err = capsys.readouterr().err
    assert "warning[DT505]" in err and "000001.tar is truncated" in err
    # A warning is said and the bundle written (the samples before the cut train).
    assert cli.main(["compile", str(spec), "-o", str(tmp_path / "bundle")]) == 0
    err = capsys.readouterr().err
    assert "warning[DT505]" in err and (tmp_path / "bundle" / "launch.sh").is_file()


def test_a_module_the_source_gives_nothing_is_dt506(tmp_path, capsys):
    # Text-only conversations: the image encoder has no input and the image generator
    # no target. Both are said at their modules; the plan prices the data block.
    (tmp_path / "set").mkdir()
    records = [{"id": str(k), "conversations": _turns(placeholders=0)} for k in range(12)]
    (tmp_path / "set" / "llava.json").write_text(json.dumps(records))
    spec = _real_spec(tmp_path, 'source = "set/llava.json"')
    assert cli.main(["check", str(spec)]) == 0
    err = capsys.readouterr().err.replace("\n", " ")
    assert err.count("warning[DT506]") == 2, err
    assert "none of its 12 samples carries an image input: encoder vit would train on " \
        "nothing" in err
    assert "none of its 12 samples carries an image generation target: generator gen " \
        "would train on nothing" in err
    # With images, the encoder has work: only the generator is said.
    _varied_llava(tmp_path / "img", [1] * 6, [5] * 6)
    spec = _real_spec(tmp_path, 'source = "img/llava.json"\n  image_folder = "img/images"')
    assert cli.main(["check", str(spec)]) == 0
    err = capsys.readouterr().err
    assert err.count("warning[DT506]") == 1 and "generator gen" in err, err


# ---- nothing to train on, samples outside the clamps ----------------------------------------

def _real_spec(root: Path, data: str, replace: dict[str, str] | None = None) -> Path:
    """tiny_cpu reading real text (a tokenizer made here) from ``data`` (the source's
    lines), with ``replace``'s edits."""
    if not (root / "tok").exists():
        make_tokenizer(root / "tok")
    text = TINY.read_text().replace('source = "data/tiny"', f'{data}\n  tokenizer = "tok"')
    for old, new in (replace or {}).items():
        assert old in text
        text = text.replace(old, new)
    spec = root / "tiny.dt"
    spec.write_text(text)
    return spec


def _empty_sources(root: Path) -> dict[str, tuple[str, str]]:
    """Sources with nothing to train on: data line -> what the error must say."""
    rng = np.random.default_rng(3)
    out = {}
    (root / "a").mkdir()
    _llava(root / "a", ["dotdot_out", "absolute_out", "symlink_out", "fifo"])
    out["a"] = ('source = "a/llava.json"\n  image_folder = "a/images"', "refused")
    (root / "b").mkdir()
    (root / "b" / "llava.json").write_text("[]")
    out["b"] = ('source = "b/llava.json"', "no samples")
    (root / "c").mkdir()
    (root / "outside").mkdir(exist_ok=True)
    _tar(root / "outside" / "x.tar", rng)
    os.symlink(root / "outside" / "x.tar", root / "c" / "000000.tar")
    os.mkfifo(root / "c" / "000001.tar")
    out["c"] = ('source = "c"', "every shard is refused")
    (root / "d").mkdir()
    with tarfile.open(root / "d" / "000000.tar", "w") as tar:
        for name, payload in (("x.jpg", b"\xff\xd8 not a jpeg"), ("x.txt", b"a caption"),
                              ("y.txt", b"   ")):
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    out["d"] = ('source = "d"', "unreadable image")
    (root / "e" / "images").mkdir(parents=True)
    (root / "e" / "outside").mkdir()
    records = [{"id": str(k), "image": _name("plain", 100 + k, root / "e", rng),
                "conversations": _turns(placeholders=3)} for k in range(3)]
    (root / "e" / "llava.json").write_text(json.dumps(records))
    out["e"] = ('source = "e/llava.json"\n  image_folder = "e/images"',
                "text does not go with its images")
    return out


def test_a_source_with_nothing_to_train_on_is_dt317(tmp_path, capsys):
    """0 readable samples stops dtc check and dtc compile at the source line, naming why:
    all refused, all damaged, empty, no text that goes with its images."""
    for data, why in _empty_sources(tmp_path).values():
        spec = _real_spec(tmp_path, data)
        assert _finishes(lambda spec=spec: cli.main(["check", str(spec)])) == 1, data
        err = capsys.readouterr().err
        assert "error[DT317]" in err and "has no sample to train on" in err and why in err, \
            (data, err)
        bundle = tmp_path / "bundle"
        assert cli.main(["compile", str(spec), "-o", str(bundle)]) == 1
        assert "error[DT317]" in capsys.readouterr().err and not bundle.exists()


def _varied_llava(root: Path, images: list[int], words: list[int]) -> None:
    """Record k with ``images[k]`` images (no placeholders: they open the first turn) and
    an answer of ``words[k]`` words."""
    rng = np.random.default_rng(len(images))
    (root / "images").mkdir(parents=True)
    records = []
    for k, (n, w) in enumerate(zip(images, words, strict=True)):
        names = []
        for j in range(n):
            (root / "images" / f"{k}_{j}.png").write_bytes(_image(rng, 16, 16, "PNG"))
            names.append(f"{k}_{j}.png")
        answer = " ".join(["dog"] * w) + "."
        record = {"id": f"r{k}", "conversations": [
            {"from": "human", "value": "What is in the image?"},
            {"from": "gpt", "value": answer}]}
        if names:
            record["image"] = names
        records.append(record)
    (root / "llava.json").write_text(json.dumps(records))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_samples_outside_the_clamps_are_warned_and_cut_as_the_spec_says(tmp_path, capsys,
                                                                        seed):
    """DT505 counts the samples above image.count's and text.tokens' clamps and says what
    the run does; the run's sources (workers and reference alike) do exactly that."""
    from dtdsl.feed.source import DatasetSource

    rng = np.random.default_rng(seed)
    images = [int(x) for x in rng.integers(0, 7, 16)]
    words = [int(x) for x in rng.integers(2, 60, 16)]
    max_images, max_tokens = int(rng.integers(1, 4)), int(rng.integers(24, 48))
    _varied_llava(tmp_path / "set", images, words)
    spec = _real_spec(tmp_path, 'source = "set/llava.json"\n  image_folder = "set/images"',
                      {"clamp [0, 3]": f"clamp [0, {max_images}]",
                       "clamp [8, 192]": f"clamp [8, {max_tokens}]"})
    program = run_frontend(str(spec), spec.read_bytes()).program
    source = DatasetSource(program, tmp_path / "set" / "llava.json")
    tokens = [source._layouts[i][0] for i in range(16)]
    assert cli.main(["check", str(spec)]) == 0
    err = capsys.readouterr().err.replace("\n", " ")
    above = sum(n > max_images for n in images)
    if above:
        kept = "1 image" if max_images == 1 else f"first {max_images} images"
        assert (f"{above} of 16 samples are above the clamp [0, {max_images}] of "
                f"image.count: each keeps its {kept}; the others are dropped") in err
    long = sum(t > max_tokens for t in tokens)
    if long:
        assert (f"{long} of 16 samples are above the clamp [8, {max_tokens}] of text.tokens: "
                f"each is cut to its first {max_tokens} text tokens") in err
    assert err.count("warning[DT505]") == (above > 0) + (long > 0) + \
        (sum(t < 8 for t in tokens) > 0)
    for i in range(16):
        sizes = source.doc_sizes(i)
        assert len(sizes.image_shapes) <= min(images[i], max_images)
        assert sizes.text_tokens <= min(tokens[i], max_tokens)
    for step in range(2):
        for pos, sz in enumerate(source.sizes(step)):
            sample = source.sample(step, pos)          # what the workers and the reference read
            assert len(sample.images) == len(sz.image_shapes) <= max_images
            assert len(sample.tokens) == sz.text_tokens <= max_tokens


# ---- images that do not decode ------------------------------------------------------------









@pytest.mark.parametrize("how, at", [("cut", 0.5), ("cut", 0.05), ("scramble", 0.0)])
def test_an_image_that_does_not_decode_is_skipped_alike_everywhere(tmp_path, tiny, caplog,
                                                                   capsys, how, at):
    """The index takes the sample (its header is fine); the run's samples leave it out in
    every process alike, logged with its file and why and counted; dtc reference trains
    without it. A sample that stops decoding after that keeps its place as a stand-in."""
    from dtdsl.feed.source import DatasetSource

    rng = np.random.default_rng(int(at * 100) + len(how))
    bad = {int(k): (how, at) for k in rng.choice(image_samples(tiny, 48), 2, replace=False)}
    data = corrupt_dataset(tmp_path / "d", tiny, 48, bad)
    with Dataset.open(data) as ds:
        assert len(ds) == 48 and not getattr(ds, "skipped", {})  # the index accepts it
        bad_keys = {ds.key(k) for k in bad}
    assert cli.main(["data", "index", str(data)]) == 0
    assert "skipped" not in capsys.readouterr().err
    with caplog.at_level("WARNING", logger="dtdsl.feed.source"):
        a = DatasetSource(tiny, data)
    assert a.left_out == {"does not decode": 2} and len(a.usable) == 46
    for k in bad:                       # once each, with its file and why
        said = [r.getMessage() for r in caplog.records
                if f"skipping sample {k:08d} (" in r.getMessage()]
        assert len(said) == 1 and f"{data / f'shard-{k // 16:06d}.tar'})" in said[0]
        assert "cannot decode a" in said[0]
    assert "46 of 48 samples are trained on" in caplog.text
    b = DatasetSource(tiny, data)                                # another process, the cache
    for step in range(4):
        assert a.keys(step) == b.keys(step) and a.sizes(step) == b.sizes(step)
        assert not bad_keys & {k for row in a.keys(step) for k in row.split("+")}
    # dtc reference, as a user runs it: it says what it skips, and trains.
    run = subprocess.run([sys.executable, "-c", "import sys; from dtdsl.cli import main; "
                          "sys.exit(main())", "reference", str(TINY), "--data", str(data),
                          "--steps", "1", "-q"], capture_output=True, text=True, timeout=600,
                         check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    assert all(f"skipping sample {key}" in run.stderr for key in bad_keys)
    assert "46 of 48 samples are trained on; skipped 2 (does not decode)" in run.stderr
    # A file changed under a running job: the sample keeps its place, a stand-in of its
    # sizes, logged once; nothing raises.
    step, pos = 0, 0
    sizes = a.sizes(step)[pos]
    shard = data / a.dataset.info(a.rows(step)[pos][0]).shard
    member = a.dataset.info(a.rows(step)[pos][0]).members[0]
    raw = bytearray(shard.read_bytes())
    raw[member.offset] ^= 0xFF                                   # its CRC fails now
    shard.write_bytes(bytes(raw))
    sample = a.sample(step, pos)
    assert len(sample.tokens) == sizes.text_tokens
    assert [tuple(im.shape[1:]) for im in sample.images] == list(sizes.image_shapes)
    assert len(a.replaced) >= 1


@pytest.mark.slow
def test_a_bundle_run_skips_an_image_that_does_not_decode_as_the_reference_does(tmp_path,
                                                                                tiny):
    """Launched with its workers, a tiny bundle over data with a corrupt image finishes
    (no crash loop), its workers say which sample they skip and why, the sample is never
    trained on, and the losses are the reference's."""
    from tests.helpers.bundle import (
        launch_ok,
        on_two_ranks,
        read_jsonl,
        reference_losses,
        worker_log,
    )

    with_images = image_samples(tiny, 48)
    bad = with_images[len(with_images) // 2]
    data = corrupt_dataset(tmp_path / "d", tiny, 48, {bad: ("cut", 0.3)})
    key = f"{bad:08d}"
    # On 2 ranks (tiny_cpu's layout at DP 2): the skip is the workers', whatever the
    # replicas they feed.
    spec = tmp_path / "tiny_cpu.dt"
    spec.write_text(on_two_ranks(TINY.read_text()))
    bundle = tmp_path / "bundle"
    assert cli.main(["compile", str(spec), "-o", str(bundle), "--data", str(data),
                     "--workers", "1"]) == 0
    run_dir = tmp_path / "run"
    launch_ok(bundle, run_dir, "--steps", "2")
    log = worker_log(run_dir)
    said = [line for line in log.splitlines() if f"skipping sample {key} (" in line]
    assert len(said) == 1 and f"shard-{bad // 16:06d}.tar)" in said[0]      # its file
    assert "cannot decode a" in said[0]                                      # and why
    assert "47 of 48 samples are trained on; skipped 1 (does not decode)" in log
    assert "restarting" not in log
    trained = {k for r in read_jsonl(run_dir / "samples.jsonl") for row in r["keys"]
               for k in row.split("+")}
    assert key not in trained and len(trained) > 16
    losses = [m["loss"] for m in read_jsonl(run_dir / "metrics.jsonl")]
    assert losses == pytest.approx(reference_losses(2, data), rel=1e-4)
