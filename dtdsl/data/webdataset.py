"""WebDataset tar shards, read directly: the files the ``webdataset`` package's
``ShardWriter`` and img2dataset write, with an index built once for random access.

**Sources.** A source is a directory (its ``*.tar`` files, sorted), a brace pattern
(``shards/{000000..004095}.tar``: numeric ranges keep the width of their first bound; and
``{a,b,c}`` alternatives), a single ``.tar``, or a list of those (``expand_source``). A
pattern or file that names no existing tar is a ``DatasetError`` naming the first missing
one. Every shard must stay in its folder (the source's folder, or a pattern's folder: the
part before its first brace) and be a regular file (``data.paths``): a symlink out of the
folder, a FIFO or a device is refused, counted in ``WebDataset.problems`` and never
opened; when nothing is left the source is a ``shards.NoSamples`` error.

**Samples.** Tar members are grouped by key as ``webdataset`` groups them: the member's
path up to the first dot of its file name is the key (``dir/00042.jpg`` and
``dir/00042.txt`` are sample ``dir/00042``), the rest is its extension. A sample takes its
text from ``txt`` (or ``text``, ``caption``), its record from ``json``, and its images from
every member whose extension ends in ``jpg``, ``jpeg``, ``png`` or ``webp`` (``jpg``, or
``0.jpg``, ``1.png``, ... in name order). Images whose extension starts with ``gen`` are
generation targets (``gen.jpg``, ``gen0.png``); the others are inputs, or targets when the
model reads no images (``image_role="target"``: a text-to-image set for a generator).
Audio clips are the members whose extension ends in ``flac``, ``wav``, ``mp3`` or ``ogg``,
video clips those ending in ``mp4``, ``webm`` or ``mkv`` (``data.media``), each kind in
name order (``0.flac``, ``1.flac``, ..., ``10.flac``: numbers as numbers); audio whose
extension starts with ``gen`` is an audio generator's target, the rest an audio
encoder's input (a ``gen`` video is not read: nothing generates video). Keys
starting with ``__`` and members of no extension are ignored. When two shards hold the
same key (two runs of a writer, both from 000000), every key is qualified by its shard's
name (``000003/000042``); a key still repeated (twice in one shard) is further qualified
by its position in the index (``000000/0001@2``), so every sample is judged by itself.

**The index** (``WebIndex``): every sample's members (offset, size, CRC-32), its text size
and token count (``shards.count_text_tokens``), each image's width and height (from its
header), each audio clip's samples and rate and each video clip's frames, duration and
frame size (``data.media.index_media``: headers and packets, nothing decoded), so a
clip's tokens are known before it is decoded. It is built by reading every shard once,
written as JSON under ``.dtdsl-index/`` beside the shards when that folder is writable (else
``$XDG_CACHE_HOME/dtdsl/index/``), and named by a fingerprint of the shards (path, size,
modification time): a changed shard makes a new index. What cannot be a sample is counted
and skipped, never a traceback: a member that is cut off (a truncated tar: the samples
before it stay), an image whose header does not decode, text that is not UTF-8 or is
empty, a sample with no text, an audio or video member that does not read as one
(``unreadable audio``, ``unreadable video``), a GNU sparse member (``sparse tar member``:
not read, its holes would be zeros of any declared size), JSON nested past the parser's
depth (``unreadable json``). ``WebIndex.skipped`` has the counts by reason. A cached
index is checked entry by entry (types, ranges, every member inside its shard, unique
keys) and built again when it does not check.

**Truncated tars.** ``tarfile`` ends a listing quietly at the first header it cannot read,
so a tar cut at a header boundary (no end-of-archive blocks), inside a header or at a
damaged header reads as a shorter archive, and one cut inside a member fails only when
that member is read (a member, or a long-name or PAX header, whose declared size runs
past the file's end is such a cut, found before anything is read). The scan therefore
checks how each tar ends: the block after the
last member must be the end-of-archive block of zeros. A shard that ends any other way
is noted in ``WebIndex.problems`` (where it stops, how many samples before that are
kept), and the sample being read at the cut is counted as ``cut off (truncated tar)``
(it may be missing members); the samples before it are used.

``WebDataset`` has ``shards.Dataset``'s reading interface (``len``, ``key``, ``info``,
``read``, iteration), so statistics, decoding and the feed read both alike.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import re
import tarfile
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtdsl.data.cache import cache_path, is_count, read_cache, write_cache
from dtdsl.data.paths import MISSING, Refused, inside, open_regular
from dtdsl.data.shards import (
    ClipInfo,
    DatasetError,
    EncodedClip,
    EncodedImage,
    Member,
    NoSamples,
    RawSample,
    SampleInfo,
    count_text_tokens,
)

__all__ = ["INDEX_FORMAT", "WebDataset", "WebIndex", "build_index", "expand_source",
           "index_path", "resolve_shards"]

INDEX_FORMAT = "dtdsl-webdataset-index"
INDEX_VERSION = 4          # 2: how each tar ends is checked (problems); 3: audio, video;
                           # 4: images in natural order, other image formats skipped
_BLOCK = tarfile.BLOCKSIZE
_IMAGE_EXT = {"jpg": "jpeg", "jpeg": "jpeg", "png": "png", "webp": "webp"}
# Image members of formats not read (``shard_format.PIL_FORMATS``): their sample is
# skipped, counted, rather than trained as text alone.
_OTHER_IMAGE_EXT = frozenset({"gif", "bmp", "tif", "tiff", "ppm", "pgm", "pbm", "pnm",
                              "ico", "jp2", "avif", "heic", "heif"})
REPEATED = "member repeated in a sample"
_TEXT_EXT = ("txt", "text", "caption")
_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"(\d+)\.\.(\d+)")
_MAX_EXPANSION = 10_000_000
CUT_OFF = "cut off (truncated tar)"
SPARSE = "sparse tar member"


def expand_source(pattern: str) -> list[str]:
    """The paths a brace pattern names, in order (``a{1..3}`` -> ``a1 a2 a3``; a range keeps
    its first bound's zero padding; ``{x,y}`` alternatives). ValueError for a range that
    runs backwards, or for more than ``_MAX_EXPANSION`` paths in all (counted before any
    is made: ``{0..99999}/{0..99999}`` names 1e10)."""
    count = 1
    for body in _BRACE.findall(pattern):
        r = _RANGE.fullmatch(body)
        if r and int(r.group(2)) < int(r.group(1)):
            raise ValueError(f"the range {{{body}}} runs backwards")
        count *= int(r.group(2)) - int(r.group(1)) + 1 if r else body.count(",") + 1
        if count > _MAX_EXPANSION:
            raise ValueError(f"{pattern!r} names more than {_MAX_EXPANSION:,} files")
    return _expand(pattern)


def _expand(pattern: str) -> list[str]:
    m = _BRACE.search(pattern)
    if m is None:
        return [pattern]
    body = m.group(1)
    r = _RANGE.fullmatch(body)
    if r:
        lo, hi = int(r.group(1)), int(r.group(2))
        width = len(r.group(1))
        items = [str(i).zfill(width) for i in range(lo, hi + 1)]
    else:
        items = body.split(",")
    out = []
    for item in items:
        out.extend(_expand(pattern[:m.start()] + item + pattern[m.end():]))
    return out


def _folder_of(pattern: str) -> str:
    """The folder of a pattern: the directory part of what precedes its first brace."""
    return os.path.dirname(pattern.split("{", 1)[0])


def _take(folder: Path, name: str, out: list[Path], refused: dict[str, str]) -> None:
    """Add ``folder/name`` to ``out`` when it is a regular file inside ``folder``; note
    it in ``refused`` otherwise (a missing file is the caller's to report)."""
    try:
        out.append(inside(folder, name))
    except Refused as err:
        if err.reason == MISSING:
            raise
        refused[str(folder / name)] = str(err)


def resolve_shards(source: str | Path | Sequence[str | Path], base_dir: str | Path = ".",
                   refused: dict[str, str] | None = None) -> list[Path]:
    """The tar files of a source (module docstring), absolute and resolved; DatasetError
    when one is missing or none is found, ``shards.NoSamples`` when every one found was
    refused. ``refused`` (when given) gets each refused file with the reason."""
    patterns = [str(source)] if isinstance(source, (str, Path)) else [str(p) for p in source]
    base = Path(base_dir)
    refusals: dict[str, str] = {} if refused is None else refused
    out: list[Path] = []
    for pattern in patterns:
        try:
            names = expand_source(pattern)
        except ValueError as err:
            raise DatasetError(f"source {pattern!r}: {err}") from None
        folder = Path(_folder_of(pattern)).expanduser()
        folder = folder if folder.is_absolute() else base / folder
        for name in names:
            path = Path(name).expanduser()
            path = path if path.is_absolute() else base / path
            if path.is_dir():        # a folder the source names: its tars
                tars = sorted(p.name for p in path.glob("*.tar"))
                if not tars:
                    raise DatasetError(f"{path} holds no dataset: no dtdsl index and no .tar "
                                       "shards")
                for tar in tars:
                    try:
                        _take(path, tar, out, refusals)
                    except Refused as err:      # a symlink to nothing
                        refusals[str(path / tar)] = str(err)
                continue
            rel = os.path.relpath(os.path.normpath(path), os.path.normpath(folder))
            try:
                _take(folder, rel, out, refusals)
            except Refused:
                shown = f"{pattern!r} ({len(names):,} files)" if len(names) > 1 else ""
                raise DatasetError(f"no such file: {path}" + (f", named by {shown}"
                                                              if shown else "")) from None
    if not out:
        if refusals:
            first = next(iter(refusals.values()))
            raise NoSamples(f"source {source!r}: every shard is refused "
                            f"({len(refusals)}; {first})")
        raise DatasetError(f"source {source!r} names no files")
    return out


def _split(name: str) -> tuple[str, str] | None:
    """(key, extension) of a tar member, as webdataset splits it; None to ignore it."""
    folder, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    if not dot or not stem or stem.startswith("__") or not ext:
        return None
    return (f"{folder}/{stem}" if folder else stem), ext.lower()


def _image_ext(ext: str) -> str | None:
    last = ext.rsplit(".", 1)[-1]
    return _IMAGE_EXT.get(last)


def _natural(ext: str) -> list[Any]:
    """A sort key that orders ``2.flac`` before ``10.flac``."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", ext)]


def _clips(key: str, members: list[list[Any]], blobs: dict[str, bytes]
           ) -> list[list[Any]] | str:
    """The sample's audio and video members as ``[ext, ClipInfo json]`` (audio first,
    each kind in name order), or why one does not read (the skip reason)."""
    from dtdsl.data.media import index_media, media_kind

    found = [(media_kind(m[0]), m[0]) for m in members]
    out = []
    for kind in ("audio", "video"):
        for _, ext in sorted(((k, e) for k, e in found if k == kind),
                             key=lambda ke: _natural(ke[1])):
            if kind == "video" and ext.startswith("gen"):
                continue            # nothing generates video
            try:
                out.append([ext, index_media(blobs[ext], f"{key}.{ext}").to_json()])
            except DatasetError:
                return f"unreadable {kind}"
    return out


def _image_size(data: bytes) -> tuple[int, int]:
    from dtdsl.data.shard_format import open_image

    with open_image(io.BytesIO(data)) as img:     # reads the header, not the pixels
        return int(img.width), int(img.height)


@dataclass
class _Scan:
    samples: list[dict[str, Any]] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1


def _finish(scan: _Scan, shard: int, key: str, members: list[list[Any]],
            blobs: dict[str, bytes]) -> None:
    """One sample's index entry from its members, or a counted skip."""
    text_member = next((m for m in members if m[0] in _TEXT_EXT), None)
    if text_member is None:
        return scan.skip("no text")
    try:
        text = blobs[text_member[0]].decode("utf-8")
    except UnicodeDecodeError:
        return scan.skip("text not UTF-8")
    if not text.strip():
        return scan.skip("empty text")
    other = next((n.rsplit(".", 1)[-1] for n, *_ in members
                  if n.rsplit(".", 1)[-1] in _OTHER_IMAGE_EXT), None)
    if other is not None:
        return scan.skip(f"{other} image (jpg, png and webp are read)")
    images = []
    # In the order of their names' numbers (``2.png`` before ``10.png``): a writer that
    # sorts names as text (webdataset's TarWriter) stores ``10`` before ``2``.
    for name, *_ in sorted(members, key=lambda m: _natural(m[0])):
        if _image_ext(name) is not None:
            try:
                images.append([name, *_image_size(blobs[name])])
            except Exception:  # noqa: BLE001 - PIL raises many kinds for a broken header
                return scan.skip("unreadable image")
    clips = _clips(key, members, blobs)
    if isinstance(clips, str):
        return scan.skip(clips)
    meta_member = next((m for m in members if m[0] == "json"), None)
    if meta_member is not None:
        try:
            record = json.loads(blobs["json"])
        except (UnicodeDecodeError, ValueError, RecursionError):
            return scan.skip("unreadable json")
        if not isinstance(record, dict):
            return scan.skip("unreadable json")
    scan.samples.append({"key": key, "shard": shard, "members": members,
                         "text": text_member[0], "text_bytes": len(blobs[text_member[0]]),
                         "text_tokens": count_text_tokens(text), "images": images,
                         "clips": clips})


def _end_problem(block: bytes, at: int) -> str | None:
    """Why a tar whose listing stopped at byte ``at`` is not whole (``block``: the bytes
    there), or None when an end-of-archive block is there."""
    if len(block) == _BLOCK and not block.strip(b"\0"):
        return None
    if not block:
        return f"it ends at byte {at:,}, a header boundary, without the end-of-archive blocks"
    if len(block) < _BLOCK:
        return f"it ends at byte {at + len(block):,}, inside a header"
    return f"the header at byte {at:,} is damaged; nothing after it is read"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


class _Bounded:
    """A shard file for ``tarfile`` whose reads never ask for more than is left in it: a
    header declaring a member (a long name, PAX records) larger than the file would
    otherwise allocate that size before finding the file short."""

    def __init__(self, file: Any, size: int):
        self._file, self._size = file, size

    def read(self, n: int = -1) -> bytes:
        left = max(0, self._size - self._file.tell())
        return self._file.read(left if n is None or n < 0 else min(n, left))

    def seek(self, *args: Any) -> int:
        return int(self._file.seek(*args))

    def tell(self) -> int:
        return int(self._file.tell())


# Magic bytes of the compressions a shard may have been written with (webdataset reads
# .tar.gz as a stream); dtdsl reads each member in place, so a shard is a plain tar.
COMPRESSED_HEAD = 263         # a tar header's magic ends there
_COMPRESSED = ((b"\x1f\x8b", "gzip", "gunzip"), (b"BZh", "bzip2", "bunzip2"),
               (b"\xfd7zXZ\x00", "xz", "unxz"), (b"\x28\xb5\x2f\xfd", "zstd", "unzstd"))


def compressed_problem(path: Path, head: bytes) -> str | None:
    """Why a shard that starts with ``head`` (its first ``COMPRESSED_HEAD`` bytes) cannot
    be read: it is compressed (None: it is not, or it is a tar: a member's name may start
    with "BZh")."""
    if head[257:262] == b"ustar":
        return None
    for magic, kind, tool in _COMPRESSED:
        if head.startswith(magic):
            return (f"{path} is {kind}-compressed: dtdsl reads plain tar shards, each "
                    f"sample in place; decompress it ({tool})")
    return None


def _scan_shard(path: Path, shard: int, scan: _Scan) -> None:
    key: str | None = None
    members: list[list[Any]] = []
    blobs: dict[str, bytes] = {}
    bad: str | None = None          # why the sample being read cannot be one
    before = len(scan.samples)
    problem = None
    size = 0
    last: tarfile.TarInfo | None = None

    def finish() -> None:
        if bad is not None:
            scan.skip(bad)
        elif key is not None:
            _finish(scan, shard, key, members, blobs)

    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size     # before tarfile reads a byte
            why = compressed_problem(path, os.pread(f.fileno(), COMPRESSED_HEAD, 0))
            if why is not None:
                raise DatasetError(why)
            with tarfile.open(fileobj=_Bounded(f, size), mode="r:") as tar:  # type: ignore[arg-type]
                for info in tar:
                    last = info
                    if not info.isfile():
                        continue
                    split = _split(info.name)
                    if split is None:
                        continue
                    k, ext = split
                    if k != key:
                        finish()
                        key, members, blobs, bad = k, [], {}, None
                    if info.sparse is not None:
                        # A GNU sparse member (no WebDataset writer makes one): its holes
                        # would be read as zeros up to the size it declares. Not read.
                        bad = SPARSE
                        continue
                    if info.offset_data + info.size > size:
                        raise EOFError(f"{info.name} is cut off")   # never read past the end
                    if bad is not None:
                        continue
                    if ext in blobs:
                        # Two members of one name: which one is the sample's? (webdataset
                        # refuses the tar.) The sample is skipped, counted.
                        bad = REPEATED
                        continue
                    data = tar.extractfile(info).read()      # type: ignore[union-attr]
                    if len(data) != info.size:
                        raise EOFError(f"{info.name} is cut off")
                    members.append([ext, info.offset_data, info.size, zlib.crc32(data)])
                    blobs[ext] = data
                # Where the listing stopped: an end-of-archive block must be there.
                problem = _end_problem(os.pread(f.fileno(), _BLOCK, tar.offset), tar.offset)
    except Refused as err:
        raise DatasetError(str(err)) from None
    except (tarfile.TarError, EOFError, OSError) as err:
        if isinstance(err, OSError) and not isinstance(err, EOFError) and \
                not path.exists():
            raise DatasetError(f"cannot read {path}: {err}") from None
        if last is None:
            problem = f"it ends at byte {size:,}, inside its first member ({err})"
        elif last.offset_data + last.size > size:
            problem = (f"it ends at byte {size:,}, inside {last.name} "
                       f"({last.size:,} bytes from byte {last.offset_data:,})")
        else:
            problem = f"it ends at byte {size:,}, inside the member after {last.name} ({err})"
    if problem is None:
        finish()
        return
    # A truncated or damaged tar: the samples before the damage stay; the one being read
    # at the cut may lack members, and goes.
    if key is not None or len(scan.samples) == before:
        scan.skip(CUT_OFF)
    scan.problems.append(f"{path.name} is truncated: {problem}; "
                         f"{_plural(len(scan.samples) - before, 'sample')} before it kept")


def _fingerprint(shards: Sequence[Path]) -> str:
    h = hashlib.sha256(f"{INDEX_FORMAT}:{INDEX_VERSION}".encode())
    for path in shards:
        st = path.stat()
        h.update(f"\0{path}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()


def index_path(shards: Sequence[Path], cache_dir: str | Path | None = None) -> Path:
    """Where the index of these shards lives (module docstring)."""
    return cache_path(shards[0].parent, f"{_fingerprint(shards)[:32]}.json", cache_dir)


@dataclass(frozen=True)
class WebIndex:
    shards: tuple[Path, ...]
    samples: tuple[dict[str, Any], ...]
    skipped: Mapping[str, int]
    path: Path | None = None          # where it is cached
    problems: tuple[str, ...] = ()    # per damaged shard, what is wrong (truncated tars)


def _unique_keys(samples: list[dict[str, Any]], shards: Sequence[Path]) -> None:
    """Make the samples' keys unique, in place. Keys name samples in the run's records
    (consumption logs, the decode check), so two samples must never share one: shards of
    two runs of a writer often both start at 000000, and then every key says its shard
    too; a key repeated within one shard (a writer run twice into the same tar) then says
    its position in the index as well, so each sample is judged by itself."""
    if len({s["key"] for s in samples}) == len(samples):
        return
    for s in samples:
        s["key"] = f"{shards[s['shard']].stem}/{s['key']}"
    if len({s["key"] for s in samples}) == len(samples):
        return
    seen: dict[str, int] = {}
    for s in samples:
        seen[s["key"]] = seen.get(s["key"], 0) + 1
    for i, s in enumerate(samples):
        if seen[s["key"]] > 1:
            s["key"] = f"{s['key']}@{i}"
    if len({s["key"] for s in samples}) < len(samples):     # "@i" met a real key
        for i, s in enumerate(samples):
            s["key"] = f"{i}/{s['key']}"


def _valid_sample(s: Any, sizes: Sequence[int]) -> bool:
    """Whether a cached sample entry is one ``_finish`` writes, every member inside its
    shard (a cache is a file someone else may have written: checked before it is used)."""
    from dtdsl.data.media import media_kind

    if not (isinstance(s, dict) and isinstance(s.get("key"), str) and is_count(s.get("shard"))
            and s["shard"] < len(sizes) and isinstance(s.get("members"), list)
            and s["members"] and isinstance(s.get("text"), str)
            and is_count(s.get("text_bytes")) and is_count(s.get("text_tokens"))
            and isinstance(s.get("images"), list) and isinstance(s.get("clips"), list)):
        return False
    size = sizes[s["shard"]]
    names = set()
    for m in s["members"]:
        if not (isinstance(m, list) and len(m) == 4 and isinstance(m[0], str)
                and all(is_count(x) for x in m[1:]) and m[1] >= _BLOCK
                and m[1] + m[2] <= size and m[3] < 2 ** 32 and m[0] not in names):
            return False
        names.add(m[0])
    if s["text"] not in names or s["text"] not in _TEXT_EXT:
        return False
    for im in s["images"]:
        if not (isinstance(im, list) and len(im) == 3 and isinstance(im[0], str)
                and im[0] in names and _image_ext(im[0]) is not None
                and is_count(im[1]) and is_count(im[2]) and im[1] > 0 and im[2] > 0):
            return False
    for clip in s["clips"]:
        if not (isinstance(clip, list) and len(clip) == 2 and isinstance(clip[0], str)
                and clip[0] in names and media_kind(clip[0]) is not None):
            return False
        try:
            ClipInfo.from_json(clip[1])
        except ValueError:
            return False
    return True


def _valid_index(data: Mapping[str, Any], shards: Sequence[Path]) -> bool:
    """Whether a cached index can be used as it is (else it is built again)."""
    samples, skipped, problems = data.get("samples"), data.get("skipped"), data.get("problems")
    if not (isinstance(samples, list) and isinstance(skipped, dict)
            and all(isinstance(k, str) and is_count(v) for k, v in skipped.items())
            and isinstance(problems, list) and all(isinstance(p, str) for p in problems)):
        return False
    try:
        sizes = [p.stat().st_size for p in shards]
    except OSError:
        return False
    return all(_valid_sample(s, sizes) for s in samples) and \
        len({s["key"] for s in samples}) == len(samples)


def build_index(shards: Sequence[Path], *, cache_dir: str | Path | None = None,
                progress: Callable[[int, int], None] | None = None,
                rebuild: bool = False) -> WebIndex:
    """The index of these shards: read from its cache, or built (every shard read once,
    ``progress(done, total)`` after each) and cached."""
    shards = [Path(p) for p in shards]
    target = index_path(shards, cache_dir)
    data = None if rebuild else read_cache(target, INDEX_FORMAT, INDEX_VERSION)
    if data is not None and data.get("shards") == [str(p) for p in shards] and \
            _valid_index(data, shards):
        return WebIndex(tuple(shards), tuple(data["samples"]), data["skipped"], target,
                        tuple(data["problems"]))
    scan = _Scan()
    for i, path in enumerate(shards):
        _scan_shard(path, i, scan)
        if progress is not None:
            progress(i + 1, len(shards))
    _unique_keys(scan.samples, shards)
    index = WebIndex(tuple(shards), tuple(scan.samples), dict(scan.skipped), target,
                     tuple(scan.problems))
    body = {"format": INDEX_FORMAT, "version": INDEX_VERSION,
            "shards": [str(p) for p in shards], "skipped": index.skipped,
            "problems": list(index.problems), "samples": list(index.samples)}
    if not write_cache(target, body):
        return dataclasses.replace(index, path=None)        # not cached
    return index


_CLIP_FIELDS = {"audio": "audio_clips", "gen_audio": "gen_audio_clips", "video": "videos"}


def _clip_role(ext: str) -> str:
    """``audio``, ``gen_audio`` or ``video``: what a clip member is to the model."""
    from dtdsl.data.media import media_kind

    kind = media_kind(ext)
    return "gen_audio" if kind == "audio" and ext.startswith("gen") else str(kind)


class WebDataset:
    """WebDataset shards opened for reading (module docstring): ``shards.Dataset``'s
    interface. ``image_role``: whether a sample's plain images are encoder ``input``s or
    generation ``target``s."""

    def __init__(self, index: WebIndex, *, image_role: str = "input",
                 refused: Mapping[str, str] | None = None):
        if image_role not in ("input", "target"):
            raise ValueError(f"image_role is input or target, not {image_role!r}")
        self.index = index
        self.refused = dict(refused or {})      # shard files refused (data.paths), and why
        self.path = index.shards[0].parent
        self.provenance: Mapping[str, Any] = {"webdataset": [str(p) for p in index.shards]}
        self._roles = [[name.startswith("gen") or image_role == "target"
                        for name, _, _ in s["images"]] for s in index.samples]
        self._infos = [self._info(s, roles) for s, roles in zip(index.samples, self._roles,
                                                                strict=True)]
        self._clip_exts = [[(ext, _clip_role(ext)) for ext, _ in s["clips"]]
                           for s in index.samples]
        self._entries = index.samples
        self._files: dict[int, io.BufferedReader] = {}

    @classmethod
    def open(cls, source: str | Path | Sequence[str | Path], *, base_dir: str | Path = ".",
             image_role: str = "input", cache_dir: str | Path | None = None,
             progress: Callable[[int, int], None] | None = None) -> WebDataset:
        refused: dict[str, str] = {}
        shards = resolve_shards(source, base_dir, refused)
        return cls(build_index(shards, cache_dir=cache_dir, progress=progress),
                   image_role=image_role, refused=refused)

    def _info(self, entry: dict[str, Any], roles: list[bool]) -> SampleInfo:
        clips = [(ClipInfo.from_json(c), _clip_role(ext)) for ext, c in entry["clips"]]
        inputs, targets = [], []
        for (_, w, h), to_generate in zip(entry["images"], roles, strict=True):
            (targets if to_generate else inputs).append((int(w), int(h)))
        return SampleInfo(
            key=entry["key"], shard=str(self.index.shards[entry["shard"]]),
            members=tuple(Member(name=m[0], offset=m[1], size=m[2], crc32=m[3])
                          for m in entry["members"]),
            text_bytes=entry["text_bytes"], text_tokens=entry["text_tokens"],
            images=tuple(inputs), gen_images=tuple(targets), audio=(), gen_audio=(),
            audio_clips=tuple(c for c, kind in clips if kind == "audio"),
            gen_audio_clips=tuple(c for c, kind in clips if kind == "gen_audio"),
            videos=tuple(c for c, kind in clips if kind == "video"))

    def __len__(self) -> int:
        return len(self._infos)

    def __enter__(self) -> WebDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    @property
    def shard_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.index.shards)

    @property
    def skipped(self) -> Mapping[str, int]:
        """Samples left out of the index, by reason."""
        return self.index.skipped

    @property
    def problems(self) -> tuple[str, ...]:
        """Shards refused or damaged, one line each (``dtc data index`` prints them)."""
        return tuple(self.index.problems) + tuple(
            f"refused: {why}" for why in self.refused.values())

    def key(self, i: int) -> str:
        return self._infos[i].key

    def info(self, i: int) -> SampleInfo:
        return self._infos[i]

    def read(self, i: int) -> RawSample:
        """Sample ``i``, read with one seek; tar headers and CRCs checked."""
        entry, info = self._entries[i], self._infos[i]
        shard = entry["shard"]
        where = self.index.shards[shard]
        file = self._files.get(shard)
        if file is None:
            try:
                file = self._files[shard] = open_regular(where)   # type: ignore[assignment]
            except Refused as err:
                raise DatasetError(f"{where} changed since it was indexed: {err}") from None
            except OSError as err:
                raise DatasetError(f"cannot read {where}: {err.strerror or err}") from None
        start = min(m.offset for m in info.members) - _BLOCK
        end = max(m.offset + m.size for m in info.members)
        try:
            buf = os.pread(file.fileno(), end - start, start)
        except OSError as err:
            raise DatasetError(f"cannot read {where}: {err.strerror or err}") from None
        if len(buf) != end - start:
            raise DatasetError(f"{where} changed since it was indexed: sample {info.key} is "
                               "cut off")
        blobs = {}
        for m in info.members:
            data = buf[m.offset - start:m.offset - start + m.size]
            if zlib.crc32(data) != m.crc32:
                raise DatasetError(f"{where} changed since it was indexed: sample "
                                   f"{info.key}, member {m.name} fails its CRC-32 check")
            blobs[m.name] = data
        text = blobs[entry["text"]].decode("utf-8")
        meta = json.loads(blobs["json"]) if "json" in blobs else {}
        images, targets = [], []
        for (name, w, h), to_generate in zip(entry["images"], self._roles[i], strict=True):
            fmt = _image_ext(name)
            assert fmt is not None
            (targets if to_generate else images).append(
                EncodedImage(format=fmt, data=blobs[name], width=int(w), height=int(h)))
        meta = {k: v for k, v in meta.items()
                if k not in ("key", "images", "gen_images", "audio", "gen_audio", "video")}
        clips = {kind: tuple(EncodedClip(info=c, data=blobs[ext]) for c, (ext, _) in zip(
            getattr(info, field), [(e, k) for e, k in self._clip_exts[i] if k == kind],
            strict=True)) for kind, field in _CLIP_FIELDS.items()}
        return RawSample(key=info.key, text=text, meta=meta, images=tuple(images),
                         gen_images=tuple(targets), audio=clips["audio"],
                         gen_audio=clips["gen_audio"], video=clips["video"])

    def __iter__(self) -> Iterator[RawSample]:
        for i in range(len(self)):
            yield self.read(i)
