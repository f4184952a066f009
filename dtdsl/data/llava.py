"""LLaVA-style conversation data, read directly: a JSON array (or JSON Lines) of records
with an image folder.

A record is ``{"id": ..., "image": "coco/train2017/000000033471.jpg", "conversations":
[{"from": "human", "value": "<image>\\nWhat ..."}, {"from": "gpt", "value": "..."}, ...]}``
as LLaVA's instruction sets have it: ``image`` is a path under the image folder (the
spec's ``image_folder``, by default the JSON's own folder), or a list of them, or absent
for a text-only conversation; turns are from ``human``, ``gpt`` or ``system`` (``user`` and
``assistant`` are read too). ``data.text`` renders the conversation with the tokenizer's
chat format, the images at their ``<image>`` placeholders, and trains on the assistant
turns only. ``audio`` and ``video`` fields (a path or a list of paths under the same
folder, as ``image``) give a record's audio clips (``.flac``, ``.wav``, ``.mp3``,
``.ogg``) and video clips (``.mp4``, ``.webm``, ``.mkv``), placed at their ``<audio>`` and
``<video>`` placeholders when the spec has an encoder that reads them (``data.media``).

**The index** is built once by reading the JSON and every image's header: per record its
byte range in the file, its key (``id``, or its position; qualified by position when ids
repeat), its text size, its images' paths, sizes in bytes and width and height, and its clips'
paths, sizes in bytes and what their headers say (``data.media.index_media``: an audio
clip's samples and rate, a video's frames, duration and frame size; nothing decoded). It is
cached like a WebDataset's (``.dtdsl-index/`` beside the JSON when that folder is
writable, else ``$XDG_CACHE_HOME/dtdsl/index/``), named by a fingerprint of the JSON
(path, size, modification time) and the image folder: a changed JSON makes a new index. A
record that cannot be a sample is counted and skipped: not an object, no conversation,
a turn from nobody known, a missing or unreadable image, clip (``unreadable audio``,
``unreadable video``: not the kind its extension says, or damaged). An image or clip
path must stay inside the image folder and name a regular file (``data.paths``): an
absolute path, one that leads out (``..``, a symlink to a file elsewhere) and a FIFO or
device are refused and counted by reason, never opened. Reading a sample checks all that
again, and that its images and clips still have the size they were indexed with.

``LlavaDataset`` has ``shards.Dataset``'s reading interface (``len``, ``key``, ``info``,
``read``, iteration).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtdsl.data.cache import cache_path, is_count, read_cache, write_cache
from dtdsl.data.paths import MISSING, Refused, inside, open_regular, read_regular
from dtdsl.data.shards import (
    ClipInfo,
    DatasetError,
    EncodedClip,
    EncodedImage,
    RawSample,
    SampleInfo,
    count_text_tokens,
    turn_text,
)

__all__ = ["INDEX_FORMAT", "LlavaDataset", "LlavaIndex", "build_index", "is_llava_source"]

INDEX_FORMAT = "dtdsl-llava-index"
INDEX_VERSION = 4          # 2: image paths checked (data.paths); 3: audio and video;
                           # 4: a byte order mark before the records
_FORMATS = {"JPEG": "jpeg", "PNG": "png", "WEBP": "webp"}
_ROLES = frozenset({"human", "gpt", "system", "user", "assistant"})
BOM = b"\xef\xbb\xbf"           # a UTF-8 byte order mark, before the records


def is_llava_source(path: str | Path) -> bool:
    """Whether ``path`` names a LLaVA-style JSON file (by its extension)."""
    return str(path).endswith((".json", ".jsonl"))


def _records(data: bytes, path: Path) -> Iterator[tuple[int, int, Any]]:
    """``(byte offset, byte size, value)`` of each record of a JSON array or JSON Lines."""
    text = data.decode("utf-8")
    # A UTF-8 byte order mark (Windows tools write one) is not part of the first record.
    bom = len(BOM) if data.startswith(BOM) else 0
    if path.suffix == ".jsonl":
        at = bom
        for line in data[bom:].split(b"\n"):
            if line.strip():
                try:
                    yield at, len(line), json.loads(line)
                except (ValueError, RecursionError):      # nested past the parser's depth
                    yield at, len(line), None
            at += len(line) + 1
        return
    decoder = json.JSONDecoder()
    i = 1 if bom else 0
    while i < len(text) and text[i].isspace():
        i += 1
    if i == len(text) or text[i] != "[":
        raise DatasetError(f"{path} is not a JSON array of records (LLaVA's format) nor a "
                           ".jsonl file")
    i += 1
    byte = len(text[:i].encode())
    prev = i
    while True:
        while i < len(text) and (text[i].isspace() or text[i] == ","):
            i += 1
        if i >= len(text):
            raise DatasetError(f"{path} ends inside its array (a cut-off file?)")
        if text[i] == "]":
            return
        try:
            value, end = decoder.raw_decode(text, i)
        except ValueError as err:
            raise DatasetError(f"{path} is not valid JSON: {err}") from None
        except RecursionError:
            raise DatasetError(f"{path} is not JSON dtc reads: a record nests deeper than "
                               "the parser goes") from None
        byte += len(text[prev:i].encode())
        size = len(text[i:end].encode())
        yield byte, size, value
        byte, prev, i = byte + size, end, end


def _fingerprint(path: Path, folder: Path) -> str:
    st = path.stat()
    h = hashlib.sha256(f"{INDEX_FORMAT}:{INDEX_VERSION}\0{path}\0{st.st_size}\0"
                       f"{st.st_mtime_ns}\0{folder}".encode())
    return h.hexdigest()


def index_path(path: Path, folder: Path, cache_dir: str | Path | None = None) -> Path:
    return cache_path(path.parent, f"{_fingerprint(path, folder)[:32]}.json", cache_dir)


@dataclass(frozen=True)
class LlavaIndex:
    path: Path                       # the JSON
    folder: Path                     # where image paths start
    samples: tuple[dict[str, Any], ...]
    skipped: Mapping[str, int]
    cached: Path | None = None


def _image_header(file: Path) -> tuple[str, int, int, int]:
    """Format, width, height and size in bytes of an image (its header only)."""
    from dtdsl.data.shard_format import open_image

    with open_regular(file) as f, open_image(f) as img:     # the header, not the pixels
        fmt = _FORMATS.get(img.format or "")
        if fmt is None:
            raise OSError(f"{img.format} images are not read")
        return fmt, int(img.width), int(img.height), os.fstat(f.fileno()).st_size


def _refused(reason: str) -> str:
    """The count an image path refused for ``reason`` goes to."""
    return "missing image" if reason == MISSING else f"image path refused ({reason})"


def _entry(position: int, offset: int, size: int, record: Any, folder: Path,
           skip: Callable[[str], None]) -> dict[str, Any] | None:
    if not isinstance(record, dict):
        return skip("not a record")
    turns = record.get("conversations")
    if not isinstance(turns, list) or not turns or not all(
            isinstance(t, dict) and str(t.get("from", t.get("role", ""))).lower() in _ROLES
            and isinstance(turn_text(t), str) for t in turns):
        return skip("no conversation")
    names = record.get("image")
    names = [] if names is None else [names] if isinstance(names, str) else names
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return skip("image not a path")
    images = []
    for name in names:
        try:
            fmt, w, h, num_bytes = _image_header(inside(folder, name))
            images.append([name, fmt, w, h, num_bytes])
        except Refused as err:
            return skip(_refused(err.reason))
        except FileNotFoundError:
            return skip("missing image")
        except Exception:  # noqa: BLE001 - PIL raises many kinds for a broken header
            return skip("unreadable image")
    clips: dict[str, list[Any]] = {}
    for kind in ("audio", "video"):
        found = _clips(kind, record.get(kind), folder)
        if isinstance(found, str):
            return skip(found)
        clips[kind] = found
    text = "\n".join(turn_text(t) for t in turns)
    try:
        text_bytes = len(text.encode())
    except UnicodeEncodeError:       # JSON's "\ud800": a lone surrogate, no character
        return skip("text not UTF-8")
    key = record.get("id", position)
    return {"key": str(key), "offset": offset, "size": size, "text_bytes": text_bytes,
            "text_tokens": count_text_tokens(text), "images": images, **clips}


def _clips(kind: str, names: Any, folder: Path) -> list[list[Any]] | str:
    """A record's ``audio`` or ``video`` paths as ``[path, bytes, ClipInfo json]`` each,
    or why one cannot be a sample's (the skip reason)."""
    from dtdsl.data.media import index_media, media_kind

    names = [] if names is None else [names] if isinstance(names, str) else names
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return f"{kind} not a path"
    out = []
    for name in names:
        if media_kind(name) != kind:
            return f"unreadable {kind}"
        try:
            data = read_regular(inside(folder, name))
            out.append([name, len(data), index_media(data, name).to_json()])
        except Refused as err:
            return f"{kind} path refused ({err.reason})" if err.reason != MISSING \
                else f"missing {kind}"
        except FileNotFoundError:
            return f"missing {kind}"
        except (DatasetError, OSError, UnicodeEncodeError):   # a path no file can have
            return f"unreadable {kind}"
    return out


def _valid_sample(s: Any, size: int) -> bool:
    """Whether a cached sample entry is one ``_entry`` writes, its byte range inside the
    JSON of ``size`` bytes (a cache someone else may have written is checked first)."""
    if not (isinstance(s, dict) and isinstance(s.get("key"), str) and is_count(s.get("offset"))
            and is_count(s.get("size")) and s["offset"] + s["size"] <= size
            and is_count(s.get("text_bytes")) and is_count(s.get("text_tokens"))
            and isinstance(s.get("images"), list)):
        return False
    for im in s["images"]:
        if not (isinstance(im, list) and len(im) == 5 and isinstance(im[0], str)
                and im[1] in _FORMATS.values() and all(is_count(x) for x in im[2:])
                and im[2] > 0 and im[3] > 0):
            return False
    for kind in ("audio", "video"):
        clips = s.get(kind)
        if not isinstance(clips, list):
            return False
        for clip in clips:
            if not (isinstance(clip, list) and len(clip) == 3 and isinstance(clip[0], str)
                    and is_count(clip[1])):
                return False
            try:
                ClipInfo.from_json(clip[2])
            except ValueError:
                return False
    return True


def _valid_index(data: Mapping[str, Any], path: Path, folder: Path) -> bool:
    """Whether a cached index can be used as it is (else it is built again)."""
    samples, skipped = data.get("samples"), data.get("skipped")
    if not (data.get("json") == str(path) and data.get("image_folder") == str(folder)
            and isinstance(samples, list) and isinstance(skipped, dict)
            and all(isinstance(k, str) and is_count(v) for k, v in skipped.items())):
        return False
    try:
        size = path.stat().st_size
    except OSError:
        return False
    return all(_valid_sample(s, size) for s in samples) and \
        len({s["key"] for s in samples}) == len(samples)


def build_index(path: str | Path, image_folder: str | Path | None = None, *,
                cache_dir: str | Path | None = None,
                progress: Callable[[int, int], None] | None = None,
                rebuild: bool = False) -> LlavaIndex:
    """The index of a LLaVA-style JSON (module docstring): read from its cache, or built
    and cached. DatasetError when the file cannot be read."""
    path = Path(path).expanduser().resolve()
    folder = Path(image_folder).expanduser().resolve() if image_folder else path.parent
    try:
        target = index_path(path, folder, cache_dir)
    except OSError as err:
        raise DatasetError(f"cannot read {path}: {err.strerror or err}") from None
    data = None if rebuild else read_cache(target, INDEX_FORMAT, INDEX_VERSION)
    if data is not None and _valid_index(data, path, folder):
        return LlavaIndex(path, folder, tuple(data["samples"]), data["skipped"], target)
    try:
        raw = read_regular(path)
    except Refused as err:
        raise DatasetError(str(err)) from None
    except OSError as err:
        raise DatasetError(f"cannot read {path}: {err.strerror or err}") from None
    skipped: dict[str, int] = {}

    def skip(reason: str) -> None:
        skipped[reason] = skipped.get(reason, 0) + 1

    samples = []
    try:
        for position, (offset, size, record) in enumerate(_records(raw, path)):
            entry = _entry(position, offset, size, record, folder, skip)
            if entry is not None:
                samples.append(entry)
            if progress is not None and position % 10_000 == 9_999:
                progress(offset + size, len(raw))
    except UnicodeDecodeError as err:
        raise DatasetError(f"{path} is not UTF-8: {err}") from None
    if progress is not None:
        progress(len(raw), len(raw))
    if len({s["key"] for s in samples}) < len(samples):
        for k, s in enumerate(samples):
            s["key"] = f"{k}/{s['key']}"
    index = LlavaIndex(path, folder, tuple(samples), skipped, target)
    body = {"format": INDEX_FORMAT, "version": INDEX_VERSION, "json": str(path),
            "image_folder": str(folder), "skipped": skipped, "samples": samples}
    if not write_cache(target, body):
        return LlavaIndex(path, folder, index.samples, skipped, None)      # not cached
    return index


class LlavaDataset:
    """A LLaVA-style JSON opened for reading (module docstring)."""

    def __init__(self, index: LlavaIndex):
        self.index = index
        self.path = index.path.parent
        self.provenance: Mapping[str, Any] = {"llava": str(index.path),
                                              "image_folder": str(index.folder)}
        self._infos = [SampleInfo(key=s["key"], shard=str(index.path), members=(),
                                  text_bytes=s["text_bytes"], text_tokens=s["text_tokens"],
                                  images=tuple((int(w), int(h)) for _, _, w, h, _ in s["images"]),
                                  gen_images=(), audio=(), gen_audio=(),
                                  audio_clips=tuple(ClipInfo.from_json(c)
                                                    for _, _, c in s["audio"]),
                                  videos=tuple(ClipInfo.from_json(c) for _, _, c in s["video"]))
                       for s in index.samples]
        self._file: Any = None

    @classmethod
    def open(cls, path: str | Path, image_folder: str | Path | None = None, *,
             cache_dir: str | Path | None = None,
             progress: Callable[[int, int], None] | None = None) -> LlavaDataset:
        return cls(build_index(path, image_folder, cache_dir=cache_dir, progress=progress))

    @property
    def fingerprint(self) -> str:
        return _fingerprint(self.index.path, self.index.folder)

    @property
    def shard_names(self) -> tuple[str, ...]:
        return (self.index.path.name,)

    @property
    def skipped(self) -> Mapping[str, int]:
        return self.index.skipped

    def __len__(self) -> int:
        return len(self._infos)

    def __enter__(self) -> LlavaDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def key(self, i: int) -> str:
        return self._infos[i].key

    def info(self, i: int) -> SampleInfo:
        return self._infos[i]

    def _record(self, i: int) -> dict[str, Any]:
        entry = self.index.samples[i]
        where = self.index.path
        file = self._file        # a local reference: threads may read at once
        if file is None:
            try:
                file = self._file = open_regular(where)
            except Refused as err:
                raise DatasetError(str(err)) from None
            except OSError as err:
                raise DatasetError(f"cannot read {where}: {err.strerror or err}") from None
        try:
            buf = os.pread(file.fileno(), entry["size"], entry["offset"])
            record = json.loads(buf)
        except (OSError, ValueError, RecursionError) as err:
            raise DatasetError(f"{where} changed since it was indexed: record "
                               f"{entry['key']} does not read ({err})") from None
        if not isinstance(record, dict):
            raise DatasetError(f"{where} changed since it was indexed: record "
                               f"{entry['key']} is not an object")
        return record

    def read_text(self, i: int) -> RawSample:
        """Sample ``i``'s text and conversation, without its images' bytes."""
        record = self._record(i)
        turns = record["conversations"]
        text = "\n".join(str(turn_text(t)) for t in turns)
        return RawSample(key=self._infos[i].key, text=text, meta={"conversations": turns})

    def read(self, i: int) -> RawSample:
        """Sample ``i`` with its images (each checked to have its indexed size)."""
        sample = self.read_text(i)
        images = tuple(EncodedImage(format=fmt, data=self._file_bytes(name, size),
                                    width=int(w), height=int(h))
                       for name, fmt, w, h, size in self.index.samples[i]["images"])
        info = self._infos[i]
        clips = {kind: tuple(EncodedClip(info=c, data=self._file_bytes(name, size))
                             for (name, size, _), c in zip(
                                 self.index.samples[i][kind],
                                 info.audio_clips if kind == "audio" else info.videos,
                                 strict=True))
                 for kind in ("audio", "video")}
        return RawSample(key=sample.key, text=sample.text, meta=sample.meta,
                         images=images, audio=clips["audio"], video=clips["video"])

    def _file_bytes(self, name: str, size: int) -> bytes:
        """The bytes of ``name`` under the folder, checked to be the size indexed."""
        file = self.index.folder / name
        try:
            data = read_regular(inside(self.index.folder, name))
        except Refused as err:
            raise DatasetError(f"{file} changed since it was indexed: {err}") from None
        except OSError as err:
            raise DatasetError(f"cannot read {file}: {err.strerror or err}") from None
        if len(data) != size:
            raise DatasetError(f"{file} changed since it was indexed ({len(data)} bytes, "
                               f"not {size})")
        return data

    def __iter__(self) -> Iterator[RawSample]:
        for i in range(len(self)):
            yield self.read(i)
