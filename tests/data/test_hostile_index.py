"""Hostile WebDataset shards, LLaVA JSON and index caches: a sparse tar member, a header
declaring more than the file holds, a key repeated within one shard, JSON nested past the
parser's depth, a damaged cache and a symlinked cache folder are each a counted skip, a
plain problem line or an index built again; never a traceback, a MemoryError or a write
outside the dataset."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from PIL import Image

from dtdsl.data.cache import cache_path, write_cache
from dtdsl.data.llava import LlavaDataset
from dtdsl.data.llava import build_index as llava_index
from dtdsl.data.shards import DatasetError
from dtdsl.data.usable import usable_samples
from dtdsl.data.webdataset import WebDataset, build_index, resolve_shards

DEEP = b"[" * 100_000 + b"]" * 100_000


def _png(w: int = 16, h: int = 16) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (10, 20, 30)).save(buf, "PNG")
    return buf.getvalue()


def _tar(path: Path, members: list[tuple[str, bytes]] | list[tuple[str, bytes, dict]],
         fmt: int = tarfile.USTAR_FORMAT) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=fmt) as tar:
        for name, data, *pax in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            if pax:
                info.pax_headers = pax[0]
            tar.addfile(info, io.BytesIO(data))
    return path


# The scan runs in a child limited to 1 GiB of address space, so the old code's
# allocation of a header's declared size fails there (or the child times out) instead
# of taking the machine's memory.
_SCAN = """
import resource, sys
from pathlib import Path
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
from dtdsl.data.webdataset import _Scan, _scan_shard
scan = _Scan()
_scan_shard(Path(sys.argv[1]), 0, scan)
print(repr(([s["key"] for s in scan.samples], scan.skipped, scan.problems)))
"""


def _scan(path: Path) -> tuple[list[str], dict[str, int], list[str]]:
    run = subprocess.run([sys.executable, "-c", _SCAN, str(path)], capture_output=True,
                         text=True, timeout=120, check=False,
                         cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0, run.stderr[-2000:]
    return eval(run.stdout)      # noqa: S307 - our own child's repr of plain values


def test_a_sparse_member_is_skipped_unread(tmp_path):
    # PAX GNU sparse 0.1: no byte stored, 3 GB of holes declared.
    shard = _tar(tmp_path / "s" / "000000.tar", [
        ("0001.txt", b"a good cat"),
        ("0002.txt", b"", {"GNU.sparse.map": "0,0", "GNU.sparse.size": str(3 * 10**9)}),
        ("0003.txt", b"another good cat")], fmt=tarfile.PAX_FORMAT)
    keys, skipped, problems = _scan(shard)
    assert keys == ["0001", "0003"] and skipped == {"sparse tar member": 1}
    assert problems == []


def test_a_header_declaring_more_than_the_file_holds_is_a_truncation(tmp_path):
    whole = _tar(tmp_path / "w" / "000000.tar",
                 [(f"{i:04d}.txt", b"text %d " % i * 300) for i in range(4)])
    raw = bytearray(whole.read_bytes())
    info = tarfile.TarInfo("0001.txt")
    info.size = 10**11
    second = 512 + 2560                      # the second member's header
    raw[second:second + 512] = info.tobuf(tarfile.GNU_FORMAT)[:512]
    huge = tmp_path / "h" / "000000.tar"
    huge.parent.mkdir()
    huge.write_bytes(bytes(raw))
    keys, skipped, problems = _scan(huge)
    assert keys == ["0000"] and skipped == {"cut off (truncated tar)": 1}
    assert len(problems) == 1 and "inside 0001.txt (100,000,000,000 bytes" in problems[0]
    assert f"it ends at byte {len(raw):,}" in problems[0]
    # A long-name header (read by tarfile itself) declaring 100 GB: a plain line too.
    name = tarfile.TarInfo("x" * 50)
    name.type, name.size = tarfile.GNUTYPE_LONGNAME, 10**11
    long = tmp_path / "l" / "000000.tar"
    long.parent.mkdir()
    long.write_bytes(name.tobuf(tarfile.GNU_FORMAT) + b"\0" * 20_000)
    keys, skipped, problems = _scan(long)
    assert keys == [] and len(problems) == 1 and "is truncated" in problems[0]


def test_a_tar_cut_inside_its_first_header_says_where(tmp_path):
    whole = _tar(tmp_path / "w" / "000000.tar", [("0000.txt", b"some text")])
    cut = tmp_path / "c" / "000000.tar"
    cut.parent.mkdir()
    cut.write_bytes(whole.read_bytes()[:100])
    ds = WebDataset.open(cut.parent)
    assert len(ds) == 0 and "it ends at byte 100," in ds.problems[0]


class _PixelCheck:
    """A decoder that reads every image's pixels (as ``decode.Decoder.check`` does)."""

    reads = ("images",)

    def check(self, sample):
        for im in sample.images:
            try:
                with Image.open(io.BytesIO(im.data)) as img:
                    img.load()
            except Exception as err:  # noqa: BLE001
                raise DatasetError(f"cannot decode an image: {err}") from None


def test_a_key_repeated_in_one_shard_judges_each_sample_by_itself(tmp_path):
    good = _png()
    _tar(tmp_path / "d" / "000000.tar", [
        ("0001.txt", b"a good cat on a mat"), ("0001.png", good),
        ("0002.txt", b"another good sample"), ("0002.png", good),
        ("0001.txt", b"a broken one"), ("0001.png", _png(64, 64)[:80])])  # header only
    ds = WebDataset.open(tmp_path / "d")
    keys = [ds.key(i) for i in range(len(ds))]
    assert len(ds) == 3 and len(set(keys)) == 3
    usable = usable_samples(ds, _PixelCheck(), [object()] * len(ds))
    assert usable.indices == (0, 1)
    assert [k for k, *_ in usable.undecodable] == [keys[2]]
    again = usable_samples(WebDataset.open(tmp_path / "d"), _PixelCheck(),
                           [object()] * len(ds))          # from the decode check's cache
    assert again.indices == (0, 1)


def test_json_nested_past_the_parsers_depth_is_skipped_or_one_line(tmp_path):
    _tar(tmp_path / "w" / "000000.tar", [
        ("0001.txt", b"a cat"), ("0001.json", DEEP), ("0002.txt", b"a dog")])
    ds = WebDataset.open(tmp_path / "w")
    assert [ds.key(i) for i in range(len(ds))] == ["0002"]
    assert ds.skipped == {"unreadable json": 1}
    good = json.dumps({"id": "a", "conversations": [{"from": "human", "value": "hi"},
                                                    {"from": "gpt", "value": "yo"}]})
    (tmp_path / "l.jsonl").write_bytes(DEEP + b"\n" + good.encode() + b"\n")
    index = llava_index(tmp_path / "l.jsonl")
    assert [s["key"] for s in index.samples] == ["a"] and index.skipped == {"not a record": 1}
    (tmp_path / "l.json").write_bytes(b"[" + good.encode() + b"," + DEEP + b"]")
    with pytest.raises(DatasetError, match="nests deeper"):
        llava_index(tmp_path / "l.json")


def _damage(path: Path, edit) -> None:
    body = json.loads(path.read_text())
    edit(body["samples"])
    path.write_text(json.dumps(body))


@pytest.mark.parametrize("edit", [
    lambda s: s[0].pop("text_bytes"),
    lambda s: s[0].__setitem__("images", [["png", "w", "h"]]),
    lambda s: s[0]["members"][0].__setitem__(1, 10**12),
    lambda s: s[1].__setitem__("key", s[0]["key"]),
    lambda s: s[0].__setitem__("shard", 7),
    lambda s: s.__setitem__(0, "not an entry"),
], ids=["no-text-bytes", "image-not-sizes", "member-past-the-end", "repeated-key",
        "no-such-shard", "not-a-dict"])
def test_a_damaged_webdataset_cache_is_built_again(tmp_path, edit):
    good = _png()
    _tar(tmp_path / "s" / "000000.tar", [
        ("0001.png", good), ("0001.txt", b"a cat"), ("0002.png", good),
        ("0002.txt", b"a dog")])
    shards = resolve_shards(str(tmp_path / "s"))
    first = build_index(shards)
    assert first.path is not None
    _damage(first.path, edit)
    ds = WebDataset(build_index(shards))
    assert ds.index.samples == first.samples
    assert [ds.read(i).text for i in range(len(ds))] == ["a cat", "a dog"]


@pytest.mark.parametrize("edit", [
    lambda s: s[0].pop("text_bytes"),
    lambda s: s[0].__setitem__("images", [["a.png", "png", "w", "h", 1]]),
    lambda s: s[0].__setitem__("offset", 10**9),
    lambda s: s[0].__setitem__("audio", [["x.wav", 3, ["x"]]]),
    lambda s: s[1].__setitem__("key", s[0]["key"]),
], ids=["no-text-bytes", "image-not-sizes", "record-past-the-end", "clip-not-info",
        "repeated-key"])
def test_a_damaged_llava_cache_is_built_again(tmp_path, edit):
    (tmp_path / "a.png").write_bytes(_png())
    records = [{"id": str(k), "image": "a.png", "conversations": [
        {"from": "human", "value": "<image>\nwhat?"}, {"from": "gpt", "value": "a cat"}]}
        for k in range(2)]
    (tmp_path / "l.json").write_text(json.dumps(records))
    first = llava_index(tmp_path / "l.json")
    assert first.cached is not None
    _damage(first.cached, edit)
    ds = LlavaDataset(llava_index(tmp_path / "l.json"))
    assert ds.index.samples == first.samples and ds.read(1).key == "1"


def test_a_symlinked_cache_folder_is_not_written_through(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    _tar(tmp_path / "s" / "000000.tar", [("0001.txt", b"a cat")])
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "s" / ".dtdsl-index").symlink_to(outside)
    index = build_index(resolve_shards(str(tmp_path / "s")))
    assert list(outside.iterdir()) == []
    assert index.path is not None and index.path.parent == tmp_path / "xdg" / "dtdsl" / "index"
    assert cache_path(tmp_path / "s", "x.json").parent == tmp_path / "xdg" / "dtdsl" / "index"
    # Asked to write there all the same: nothing is written through the link.
    assert not write_cache(tmp_path / "s" / ".dtdsl-index" / "x.json", {"a": 1})
    assert list(outside.iterdir()) == []


def test_the_temporary_cache_file_is_never_a_link_someone_placed(tmp_path):
    folder = tmp_path / ".dtdsl-index"
    folder.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("precious")
    target = folder / "x.json"
    placed = folder / f"x.json.{os.getpid()}.partial"     # the name it used to take
    placed.symlink_to(victim)
    assert write_cache(target, {"format": "f", "version": 1})
    assert victim.read_text() == "precious"
    assert not target.is_symlink() and json.loads(target.read_text())["format"] == "f"
    assert placed.is_symlink()              # someone else's, left as it was
    assert [p.name for p in folder.iterdir() if p.name.endswith(".partial")] == [placed.name]
