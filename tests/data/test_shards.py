"""The shard format: round trips, determinism, random access, and every way to break it."""

from __future__ import annotations

import hashlib
import json
import random
import tarfile
from pathlib import Path

import numpy as np
import pytest

from dtdsl.data.encode import encode_audio, encode_image
from dtdsl.data.shards import (
    INDEX_NAME,
    Dataset,
    DatasetError,
    DatasetExists,
    RawSample,
    count_text_tokens,
    sample_key,
    write_dataset,
)

from .conftest import NUM_SAMPLES, SHARD_SIZE


def _pixels(w: int, h: int, shade: int) -> np.ndarray:
    image = np.zeros((h, w, 3), dtype=np.uint8)
    image[..., 0] = shade
    image[: h // 2, :, 1] = 200
    return image


def _samples() -> list[RawSample]:
    """Five hand-made samples: no images, PNG and JPEG, generated images, audio, meta."""
    rng = np.random.default_rng(0)
    return [
        RawSample(key=sample_key(0), text="plain text, nothing else."),
        RawSample(key=sample_key(1), text="two images: één ✓", meta={"source": "hand"},
                  images=(encode_image(_pixels(24, 16, 10), "png"),
                          encode_image(_pixels(8, 40, 99), "jpeg"))),
        RawSample(key=sample_key(2), text="",
                  gen_images=(encode_image(_pixels(64, 64, 3), "png"),)),
        RawSample(key=sample_key(3), text="audio in and out",
                  audio=(encode_audio(rng.standard_normal((30, 128))),),
                  gen_audio=(encode_audio(rng.standard_normal((12, 128))),
                             encode_audio(rng.standard_normal((7, 128))))),
        RawSample(key=sample_key(4), text="twelve images " * 3,
                  images=tuple(encode_image(_pixels(8 + k, 8, k), "png") for k in range(12))),
    ]


def test_round_trip(tmp_path: Path):
    samples = _samples()
    written = write_dataset(tmp_path / "d", samples, samples_per_shard=2,
                            provenance={"made_by": "test"})
    assert (written.num_samples, written.num_shards) == (5, 3)
    with Dataset.open(tmp_path / "d") as ds:
        assert len(ds) == 5
        assert ds.shard_names == ("shard-000000.tar", "shard-000001.tar", "shard-000002.tar")
        assert ds.provenance == {"made_by": "test"}
        assert [ds.read(i) for i in range(5)] == samples
        assert list(ds) == samples
        assert [ds.key(i) for i in range(5)] == [f"0000000{i}" for i in range(5)]
        info = ds.info(1)
        assert info.shard == "shard-000000.tar"
        assert info.images == ((24, 16), (8, 40))
        assert info.text_bytes == len("two images: één ✓".encode())
        assert info.text_tokens == count_text_tokens("two images: één ✓") == 5
        assert ds.info(3).audio == (30,) and ds.info(3).gen_audio == (12, 7)
        assert ds.info(2).gen_images == ((64, 64),)
        assert [m.name for m in ds.info(4).members][:3] == ["img0.png", "img1.png", "img10.png"]
        audio = ds.read(3).gen_audio[1].array()
        assert audio.dtype == np.float32 and audio.shape == (7, 128)


def test_tars_are_plain_webdataset_tars_with_the_indexed_offsets(tmp_path: Path):
    write_dataset(tmp_path, _samples(), samples_per_shard=10)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert index["format"] == "dtdsl-shards" and index["version"] == 1
    with tarfile.open(tmp_path / "shard-000000.tar") as tar:
        members = tar.getmembers()
        names = [m.name for m in members]
        assert names == sorted(names)
        assert names[:2] == ["00000000.json", "00000000.txt"]
        assert "00000001.img1.jpg" in names and "00000003.genaud1.npy" in names
        assert {(m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode) for m in members} == \
            {(0, 0, 0, "", "", 0o644)}
        by_name = {m.name: m for m in members}
        for entry in index["samples"]:
            for name, offset, size, _ in entry["members"]:
                member = by_name[f"{entry['key']}.{name}"]
                assert (member.offset_data, member.size) == (offset, size)
        record = json.loads(tar.extractfile("00000001.json").read())
    assert record == {"key": "00000001", "source": "hand", "audio": [], "gen_audio": [],
                      "gen_images": [],
                      "images": [{"w": 24, "h": 16, "format": "png"},
                                 {"w": 8, "h": 40, "format": "jpeg"}]}


def test_same_samples_give_byte_identical_shards(tmp_path: Path, tiny):
    from dtdsl.data.synth import synthesize

    for name in ("a", "b"):
        write_dataset(tmp_path / name, synthesize(tiny, 40, seed=3), samples_per_shard=16)
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == ["index.json", "shard-000000.tar", "shard-000001.tar", "shard-000002.tar"]
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_random_access_equals_sequential_iteration(tiny_dataset: Path):
    with Dataset.open(tiny_dataset) as ds:
        assert len(ds) == NUM_SAMPLES
        assert len(ds.shard_names) == -(-NUM_SAMPLES // SHARD_SIZE)
        streamed = list(ds)
        order = list(range(len(ds)))
        random.Random(0).shuffle(order)
        for i in order[:400]:
            assert ds.read(i) == streamed[i]
        assert [s.key for s in streamed] == [sample_key(i) for i in range(NUM_SAMPLES)]


def test_empty_dataset(tmp_path: Path):
    assert write_dataset(tmp_path / "e", []).num_shards == 0
    with Dataset.open(tmp_path / "e") as ds:
        assert len(ds) == 0 and list(ds) == []


# ---- writing mistakes ------------------------------------------------------------------

def test_keys_must_be_positions(tmp_path: Path):
    with pytest.raises(ValueError, match="key '00000007'.*'00000000'"):
        write_dataset(tmp_path, [RawSample(key=sample_key(7), text="x")])


def test_image_size_and_format_are_checked(tmp_path: Path):
    image = encode_image(_pixels(10, 6, 0), "png")
    lying = type(image)(format="jpeg", data=image.data, width=10, height=6)
    with pytest.raises(ValueError, match="says jpeg 10x6 but is png 10x6"):
        write_dataset(tmp_path / "a", [RawSample(key=sample_key(0), text="", images=(lying,))])
    with pytest.raises(ValueError, match="not a readable file"):
        bad = type(image)(format="png", data=b"nope", width=1, height=1)
        write_dataset(tmp_path / "b", [RawSample(key=sample_key(0), text="", images=(bad,))])


def test_meta_may_not_override_the_standard_fields(tmp_path: Path):
    with pytest.raises(ValueError, match="meta may not set images"):
        write_dataset(tmp_path, [RawSample(key=sample_key(0), text="", meta={"images": []})])


def _state(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (links as their target's text) by relative path."""
    return {p.relative_to(folder).as_posix(): (b"-> " + str(p.readlink()).encode()
                                                if p.is_symlink() else p.read_bytes())
            for p in sorted(folder.rglob("*")) if p.is_symlink() or p.is_file()}


def test_non_empty_directory_needs_overwrite(tmp_path: Path):
    out = tmp_path / "d"
    out.mkdir()
    made = out.stat().st_ino
    write_dataset(out, _samples(), samples_per_shard=1)
    assert out.stat().st_ino == made        # an empty folder someone made is filled
    with pytest.raises(DatasetExists, match=f"{out} is not empty"):
        write_dataset(out, _samples()[:1])
    write_dataset(out, _samples()[:2], samples_per_shard=1, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == \
        ["index.json", "shard-000000.tar", "shard-000001.tar"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]     # nothing staged is left
    with Dataset.open(out) as ds:
        assert list(ds) == _samples()[:2]
    index = json.loads((out / INDEX_NAME).read_text())
    for shard in index["shards"]:
        assert shard["sha256"] == hashlib.sha256((out / shard["name"]).read_bytes()).hexdigest()


def test_files_it_did_not_write_are_never_touched(tmp_path: Path):
    """Someone's WebDataset shards have our shard names: without our index the folder is
    refused, overwrite or not, and nothing in it changes."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    for name, data in (("shard-000000.tar", b"their data"), ("index.json", b'{"a": 1}')):
        (theirs / name).write_bytes(data)
    for overwrite in (False, True):
        with pytest.raises(DatasetError, match="holds files dtdsl did not write"):
            write_dataset(theirs, _samples(), overwrite=overwrite)
    assert _state(theirs) == {"index.json": b'{"a": 1}', "shard-000000.tar": b"their data"}


@pytest.mark.parametrize("name", ["shard-000003.tar", "notes.txt", "sub/x",
                                  "shard-000000.tar.partial"])
def test_a_file_the_index_does_not_list_is_refused_not_replaced(tmp_path: Path, name):
    """Ours, with someone's file beside the shards the index lists (one with the name of a
    shard the new dataset would write): refused, overwrite or not; nothing changes."""
    out = tmp_path / "d"
    write_dataset(out, _samples()[:2], samples_per_shard=1)
    (out / name).parent.mkdir(exist_ok=True)
    (out / name).write_bytes(b"not ours")
    before = _state(out)
    for overwrite in (False, True):
        with pytest.raises(DatasetError, match=f"{out} holds files dtdsl did not write "
                           f"\\({name.split('/')[0]}"):
            write_dataset(out, _samples(), samples_per_shard=1, overwrite=overwrite)
    assert _state(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]
    with Dataset.open(out) as ds:
        assert list(ds) == _samples()[:2]


def test_a_changed_shard_is_refused_and_nothing_removed(tmp_path: Path):
    out = tmp_path / "d"
    write_dataset(out, _samples(), samples_per_shard=2)
    _flip(out / "shard-000001.tar", 700)           # same size, other bytes
    before = _state(out)
    with pytest.raises(DatasetError, match=f"{out / 'shard-000001.tar'} was changed after "
                       "dtdsl wrote it"):
        write_dataset(out, _samples()[:1], overwrite=True)
    assert _state(out) == before


@pytest.mark.parametrize("name", ["../victim.txt", "/VICTIM", "sub/../../victim.txt"])
def test_an_index_naming_a_path_outside_is_refused_before_anything_is_removed(
        tmp_path: Path, name):
    out = tmp_path / "d"
    write_dataset(out, _samples(), samples_per_shard=2)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    name = name.replace("/VICTIM", str(victim))
    index = json.loads((out / INDEX_NAME).read_text())
    index["shards"][2]["name"] = name
    (out / INDEX_NAME).write_text(json.dumps(index))
    before = _state(out)
    with pytest.raises(DatasetError, match="corrupt index"):
        write_dataset(out, _samples()[:1], overwrite=True)
    assert victim.read_text() == "precious" and _state(out) == before


def test_links_are_refused_and_their_targets_untouched(tmp_path: Path):
    real = tmp_path / "real"
    write_dataset(real, _samples(), samples_per_shard=2)
    before = _state(real)
    link = tmp_path / "link"
    link.symlink_to(real)
    for overwrite in (False, True):
        with pytest.raises(DatasetError, match=f"{link} is a symbolic link"):
            write_dataset(link, _samples()[:1], overwrite=overwrite)
    # A listed shard that is a link to someone's file.
    victim = tmp_path / "victim.tar"
    victim.write_bytes((real / "shard-000002.tar").read_bytes())
    (real / "shard-000002.tar").unlink()
    (real / "shard-000002.tar").symlink_to(victim)
    with pytest.raises(DatasetError, match=f"{real / 'shard-000002.tar'} is a symbolic link"):
        write_dataset(real, _samples()[:1], overwrite=True)
    assert victim.read_bytes() == before["shard-000002.tar"]
    assert _state(real) == {**before, "shard-000002.tar": b"-> " + str(victim).encode()}


def test_an_interrupted_write_leaves_the_old_dataset(tmp_path: Path):
    out = tmp_path / "d"
    write_dataset(out, _samples(), samples_per_shard=2)
    before = _state(out)

    def broken():
        yield from _samples()[:3]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_dataset(out, broken(), samples_per_shard=1, overwrite=True)
    assert _state(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_a_dataset_indexed_without_checksums_is_replaced_only_when_it_reads_back(
        tmp_path: Path):
    """An index of an earlier dtdsl (no sha256 per shard): its shards go only when the
    whole dataset reads back as the index says."""
    out = tmp_path / "d"
    write_dataset(out, _samples(), samples_per_shard=2)
    index = json.loads((out / INDEX_NAME).read_text())
    for shard in index["shards"]:
        del shard["sha256"]
    (out / INDEX_NAME).write_text(json.dumps(index))
    with Dataset.open(out) as ds:
        member = ds.info(3).members[1]
    _flip(out / "shard-000001.tar", member.offset + 1)
    before = _state(out)
    with pytest.raises(DatasetError, match=f"{out / 'shard-000001.tar'} was changed after"):
        write_dataset(out, _samples()[:1], overwrite=True)
    assert _state(out) == before
    _flip(out / "shard-000001.tar", member.offset + 1)
    write_dataset(out, _samples()[:1], overwrite=True)
    with Dataset.open(out) as ds:
        assert list(ds) == _samples()[:1]


# ---- reading broken datasets -------------------------------------------------------------

@pytest.fixture
def small(tmp_path: Path) -> Path:
    write_dataset(tmp_path / "d", _samples(), samples_per_shard=3)
    return tmp_path / "d"


def test_missing_index(tmp_path: Path):
    with pytest.raises(DatasetError, match=f"no dataset index {tmp_path / INDEX_NAME}"):
        Dataset.open(tmp_path)
    with pytest.raises(DatasetError, match=f"no dataset at {tmp_path / 'nope'}"):
        Dataset.open(tmp_path / "nope")


@pytest.mark.parametrize("edit, message", [
    (lambda text: text[:-40], "not JSON"),
    (lambda text: text.replace('"version": 1', '"version": 9'), "format version 9"),
    (lambda text: text.replace('"format": "dtdsl-shards"', '"format": "x"'),
     "not a dtdsl dataset index"),
    (lambda text: text.replace('"num_samples": 5', '"num_samples": 6'),
     "num_samples is 6 but 5 samples"),
    (lambda text: text.replace('"key":"00000002"', '"key":"00000009"'),
     "sample 2: key '00000009'"),
    (lambda text: text.replace('"images":[[24,16],[8,40]]', '"images":[[24,16]]'),
     "sample 1: members .* do not match its sizes"),
    (lambda text: text.replace('"shard":1', '"shard":7'), "shard 7 is not one of the 2"),
])
def test_corrupt_index(small: Path, edit, message):
    index = small / INDEX_NAME
    index.write_text(edit(index.read_text()))
    with pytest.raises(DatasetError, match=message) as err:
        Dataset.open(small)
    assert str(index) in str(err.value)


def test_missing_grown_or_truncated_shard(small: Path):
    shard = small / "shard-000001.tar"
    data = shard.read_bytes()
    shard.write_bytes(data + b"\0" * 512)          # longer than recorded: not ours any more
    with pytest.raises(DatasetError, match=f"corrupt shard {shard}: .* bytes, the index says"):
        Dataset.open(small)
    shard.write_bytes(data)
    with Dataset.open(small) as whole:
        infos = [whole.info(i) for i in range(len(whole))]
    # Cut anywhere: the samples lying whole before the cut stay and read; the others are
    # counted, and the shard is named.
    for cut in sorted({0, 1, 511, 512, 1000, len(data) // 2, len(data) - 1024,
                       len(data) - 1}):
        shard.write_bytes(data[:cut])
        with Dataset.open(small) as ds:
            fits = [i for i in infos if i.shard != shard.name or
                    max(m.offset + m.size for m in i.members) <= cut]
            assert [ds.key(i) for i in range(len(ds))] == [i.key for i in fits]
            lost = len(infos) - len(fits)
            assert dict(ds.skipped) == ({"cut off (truncated shard)": lost} if lost else {})
            assert any(p.startswith(f"{shard.name} is truncated") and f"{lost} samples" in p
                       for p in ds.problems)
            assert [r.key for r in ds] == [ds.read(i).key for i in range(len(ds))]
    shard.unlink()
    with pytest.raises(DatasetError, match=f"missing shard {shard}"):
        Dataset.open(small)


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupt_member_data_fails_the_crc(small: Path):
    with Dataset.open(small) as ds:
        member = ds.info(1).members[0]
    shard = small / "shard-000000.tar"
    _flip(shard, member.offset + 3)
    with Dataset.open(small) as ds:
        ds.read(0)   # other samples still read
        with pytest.raises(DatasetError, match=f"corrupt shard {shard}: sample 00000001: "
                           f"member {member.name} fails its CRC-32"):
            ds.read(1)
        with pytest.raises(DatasetError, match="fails its CRC-32"):
            list(ds)


def test_corrupt_member_header(small: Path):
    with Dataset.open(small) as ds:
        member = ds.info(4).members[2]
    shard = small / "shard-000001.tar"
    _flip(shard, member.offset - 512 + 2)     # a byte of the member's name
    with Dataset.open(small) as ds, pytest.raises(DatasetError, match=f"corrupt shard {shard}"):
        ds.read(4)
