"""The dataset format's parts (``data.shards``' module docstring describes the whole): the
constants, errors and key names, a sample as encoded members (``RawSample`` and its
images, audio and clips, checked and turned into tar members), and ``index.json``'s
entries parsed and checked (``SampleInfo``, ``Member``)."""

from __future__ import annotations

import io
import json
import re
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from dtdsl.errors import DtdslError

__all__ = ["DEFAULT_SAMPLES_PER_SHARD", "FORMAT", "INDEX_NAME", "VERSION", "ClipInfo",
           "DatasetError", "DatasetExists", "EncodedAudio", "EncodedClip", "EncodedImage",
           "Member", "NoSamples", "RawSample", "SampleInfo", "count_text_tokens",
           "open_image", "sample_key", "shard_name", "text_pieces", "turn_text"]

FORMAT = "dtdsl-shards"
VERSION = 1
INDEX_NAME = "index.json"
DEFAULT_SAMPLES_PER_SHARD = 1000
_BLOCK = tarfile.BLOCKSIZE          # one USTAR header block precedes every member's data
_RESERVED = frozenset({"key", "images", "gen_images", "audio", "gen_audio"})
_IMAGE_EXT = {"png": "png", "jpeg": "jpg"}
_EXT_FORMAT = {"png": "png", "jpg": "jpeg"}
_SHARD = re.compile(r"shard-\d{6,}\.tar")
# The image formats read, by Pillow's names: Pillow identifies a file by its bytes, not its
# name, and would open any format it has a plugin for (its EPS plugin runs Ghostscript on
# the file): a dataset's image is opened as one of these or not at all.
PIL_FORMATS = ("JPEG", "PNG", "WEBP")
# One text token per word (a run of letters, digits or underscores) and per other
# non-space character: the rule of the index's text_tokens and of decode.Tokenizer.
_PIECE = re.compile(r"\w+|[^\w\s]")


def open_image(file: Any) -> Any:
    """``PIL.Image.open(file)`` of a JPEG, PNG or WebP image only (``PIL_FORMATS``); as
    Pillow, ``UnidentifiedImageError`` (an OSError) for anything else."""
    from PIL import Image

    return Image.open(file, formats=PIL_FORMATS)


class DatasetError(DtdslError):
    """A dataset that cannot be read or written: the message names the file."""


class DatasetExists(DatasetError):
    """A dataset is where one would be written, and nobody said to replace it."""


class NoSamples(DatasetError):
    """A source with nothing left to read: every file it names refused, every sample
    damaged, or none at all. The message says which."""


def text_pieces(text: str) -> list[str]:
    """The pieces (tokens) of ``text``: words and single punctuation characters."""
    return _PIECE.findall(text)


def turn_text(turn: Mapping[str, Any]) -> Any:
    """A conversation turn's text: LLaVA's ``value``, or ``content`` as the chat format
    of ``{"role": ..., "content": ...}`` turns writes it (not a string where neither is
    one: the caller's check refuses it)."""
    return turn.get("value", turn.get("content", ""))


def count_text_tokens(text: str) -> int:
    """How many tokens ``text`` has under ``text_pieces`` (the index's ``text_tokens``)."""
    return len(_PIECE.findall(text))


def sample_key(index: int) -> str:
    """The key of the sample at position ``index`` of a dataset."""
    return f"{index:08d}"


def shard_name(index: int) -> str:
    return f"shard-{index:06d}.tar"


# ---- samples ----------------------------------------------------------------------------

@dataclass(frozen=True)
class EncodedImage:
    """An image file's bytes and its size in pixels."""

    format: Literal["png", "jpeg", "webp"]   # webp: read from WebDataset shards only
    data: bytes = field(repr=False)
    width: int
    height: int

    def __post_init__(self) -> None:
        if self.format not in (*_IMAGE_EXT, "webp"):
            raise ValueError(f"image format must be png, jpeg or webp, not {self.format!r}")


@dataclass(frozen=True)
class EncodedAudio:
    """Log-mel frames as ``.npy`` bytes of a float32 ``[frames, bins]`` array, or
    ``[frames, channels, bins]`` for an encoder of several input channels (``ir.modal``)."""

    data: bytes = field(repr=False)
    frames: int
    bins: int
    channels: int = 1               # 1: [frames, bins], no channel axis

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.frames, *((self.channels,) if self.channels > 1 else ()), self.bins)

    def array(self) -> np.ndarray:
        """The float32 array (``shape``)."""
        return np.load(io.BytesIO(self.data), allow_pickle=False)


@dataclass(frozen=True)
class ClipInfo:
    """What an index knows of an audio or video file without decoding it (``data.media``):
    its name (its extension says the format), an audio clip's ``samples`` per channel at
    ``rate`` Hz, a video clip's ``frames`` shown, ``duration`` in seconds (None: no
    timing) and frame size from its header (0: not given)."""

    name: str
    samples: int = 0
    rate: int = 0
    frames: int = 0
    duration: float | None = None
    width: int = 0
    height: int = 0

    def to_json(self) -> list[Any]:
        return [self.name, self.samples, self.rate, self.frames, self.duration, self.width,
                self.height]

    @staticmethod
    def from_json(entry: Any) -> ClipInfo:
        """ValueError for an entry that is not ``to_json``'s."""
        if not (isinstance(entry, list) and len(entry) == 7 and isinstance(entry[0], str)
                and all(_is_count(x) for x in (*entry[1:4], *entry[5:]))
                and (entry[4] is None or isinstance(entry[4], (int, float)))):
            raise ValueError(f"clip {entry!r} is not [name, samples, rate, frames, "
                             "duration, width, height]")
        return ClipInfo(entry[0], entry[1], entry[2], entry[3],
                        None if entry[4] is None else float(entry[4]), entry[5], entry[6])


@dataclass(frozen=True)
class EncodedClip:
    """An audio or video file's bytes, as stored (``.flac``, ``.mp4``, ...), with what its
    index says of it."""

    info: ClipInfo
    data: bytes = field(repr=False)


@dataclass(frozen=True)
class RawSample:
    """One sample as stored: text, encoded images and audio.

    ``meta`` holds the JSON record's extra fields; the standard ones (``key``, the
    image and audio sizes) come from the other attributes."""

    key: str
    text: str
    meta: Mapping[str, Any] = field(default_factory=dict)
    images: tuple[EncodedImage, ...] = ()
    gen_images: tuple[EncodedImage, ...] = ()
    # ``.npy`` frames (a dtdsl dataset: precomputed features) or audio files
    audio: tuple[EncodedAudio | EncodedClip, ...] = ()
    gen_audio: tuple[EncodedAudio | EncodedClip, ...] = ()
    video: tuple[EncodedClip, ...] = ()


def _audio_entry(a: EncodedAudio) -> dict[str, int]:
    # "channels" only where there are several: a one-channel clip's entry is as it was.
    entry = {"frames": a.frames, "bins": a.bins}
    return entry if a.channels == 1 else {**entry, "channels": a.channels}


def _record(raw: RawSample) -> dict[str, Any]:
    clash = sorted(_RESERVED & set(raw.meta))
    if clash:
        raise ValueError(f"sample {raw.key}: meta may not set {', '.join(clash)} (they come "
                         "from the sample's own fields)")
    record = dict(raw.meta)
    record.update(
        key=raw.key,
        images=[{"w": i.width, "h": i.height, "format": i.format} for i in raw.images],
        gen_images=[{"w": i.width, "h": i.height, "format": i.format}
                    for i in raw.gen_images],
        audio=[_audio_entry(a) for a in raw.audio],
        gen_audio=[_audio_entry(a) for a in raw.gen_audio])
    return record


def _check_image(raw: RawSample, image: EncodedImage) -> None:
    """The bytes are the format and size the sample says (Pillow reads only the header)."""
    from PIL import UnidentifiedImageError

    try:
        with open_image(io.BytesIO(image.data)) as img:
            found, size = (img.format or "").lower(), img.size
    except (UnidentifiedImageError, OSError) as err:
        raise ValueError(f"sample {raw.key}: an image is not a readable file: {err}") from None
    if found != image.format or size != (image.width, image.height):
        raise ValueError(f"sample {raw.key}: an image says {image.format} "
                         f"{image.width}x{image.height} but is {found} {size[0]}x{size[1]}")


def _check_audio(raw: RawSample, audio: EncodedAudio) -> None:
    try:
        buf = io.BytesIO(audio.data)
        version = np.lib.format.read_magic(buf)
        read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                       else np.lib.format.read_array_header_2_0)
        shape, fortran, dtype = read_header(buf)
    except (ValueError, OSError) as err:
        raise ValueError(f"sample {raw.key}: audio is not a .npy array: {err}") from None
    if dtype != np.dtype("<f4") or fortran or shape != audio.shape:
        raise ValueError(f"sample {raw.key}: audio says float32 {list(audio.shape)} "
                         f"but holds {dtype} {list(shape)}")


def _members(raw: RawSample) -> list[tuple[str, bytes]]:
    """The sample's members as (name after ``KEY.``, bytes), sorted by name."""
    for image in raw.images + raw.gen_images:
        _check_image(raw, image)
    for audio in raw.audio + raw.gen_audio:
        _check_audio(raw, audio)
    record = json.dumps(_record(raw), sort_keys=True, separators=(",", ":")).encode()
    out = [("txt", raw.text.encode("utf-8")), ("json", record)]
    out += [(f"img{k}.{_IMAGE_EXT[i.format]}", i.data) for k, i in enumerate(raw.images)]
    out += [(f"gen{k}.{_IMAGE_EXT[i.format]}", i.data) for k, i in enumerate(raw.gen_images)]
    out += [(f"aud{k}.npy", a.data) for k, a in enumerate(raw.audio)]
    out += [(f"genaud{k}.npy", a.data) for k, a in enumerate(raw.gen_audio)]
    return sorted(out)


# ---- the index -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Member:
    """Where one member's bytes are in its shard."""

    name: str       # after "KEY.", e.g. "img0.png"
    offset: int     # of the data (TarInfo.offset_data); the header is the block before
    size: int
    crc32: int


@dataclass(frozen=True)
class SampleInfo:
    """A sample's place and sizes, from the index alone."""

    key: str
    shard: str
    members: tuple[Member, ...]
    text_bytes: int
    text_tokens: int
    images: tuple[tuple[int, int], ...]        # (width, height) of each input image
    gen_images: tuple[tuple[int, int], ...]
    audio: tuple[int, ...]                     # frames of each input clip (.npy)
    gen_audio: tuple[int, ...]
    # Audio and video files (WebDataset members, LLaVA paths), from their headers
    audio_clips: tuple[ClipInfo, ...] = ()
    gen_audio_clips: tuple[ClipInfo, ...] = ()
    videos: tuple[ClipInfo, ...] = ()

    @property
    def audio_count(self) -> int:
        """Input audio clips, whatever their form."""
        return len(self.audio) + len(self.audio_clips)

    @property
    def gen_audio_count(self) -> int:
        """Audio generation targets, whatever their form."""
        return len(self.gen_audio) + len(self.gen_audio_clips)

    def _entry(self, shard: int) -> dict[str, Any]:
        return {"key": self.key, "shard": shard,
                "members": [[m.name, m.offset, m.size, m.crc32] for m in self.members],
                "text_bytes": self.text_bytes, "text_tokens": self.text_tokens,
                "images": [list(s) for s in self.images],
                "gen_images": [list(s) for s in self.gen_images],
                "audio": list(self.audio), "gen_audio": list(self.gen_audio)}


@dataclass(frozen=True)
class _Shard:
    name: str
    num_samples: int
    size_bytes: int


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _parse_sample(i: int, entry: Any, shards: list[_Shard]) -> SampleInfo:
    """One index entry, checked; ValueError says what is wrong."""
    if not isinstance(entry, dict):
        raise ValueError("not an object")
    missing = sorted({"key", "shard", "members", "text_bytes", "text_tokens", "images",
                      "gen_images", "audio", "gen_audio"} - set(entry))
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    if entry["key"] != sample_key(i):
        raise ValueError(f"key {entry['key']!r}, expected {sample_key(i)!r}")
    shard = entry["shard"]
    if not _is_count(shard) or shard >= len(shards):
        raise ValueError(f"shard {shard!r} is not one of the {len(shards)} shards")
    size = shards[shard].size_bytes
    members = []
    for m in entry["members"] if isinstance(entry["members"], list) else [None]:
        if not (isinstance(m, list) and len(m) == 4 and isinstance(m[0], str)
                and all(map(_is_count, m[1:]))):
            raise ValueError(f"member {m!r} is not [name, offset, size, crc32]")
        if m[1] < _BLOCK or m[1] + m[2] > size:
            raise ValueError(f"member {m[0]} at {m[1]}+{m[2]} lies outside its shard "
                             f"({size} bytes)")
        members.append(Member(name=m[0], offset=m[1], size=m[2], crc32=m[3]))
    for name in ("text_bytes", "text_tokens"):
        if not _is_count(entry[name]):
            raise ValueError(f"{name} {entry[name]!r} is not a count")
    pairs = {}
    for name in ("images", "gen_images"):
        items = entry[name]
        if not isinstance(items, list) or not all(
                isinstance(p, list) and len(p) == 2 and all(map(_is_count, p)) for p in items):
            raise ValueError(f"{name} is not a list of [w, h]")
        pairs[name] = tuple((p[0], p[1]) for p in items)
    counts = {}
    for name in ("audio", "gen_audio"):
        items = entry[name]
        if not isinstance(items, list) or not all(map(_is_count, items)):
            raise ValueError(f"{name} is not a list of frame counts")
        counts[name] = tuple(items)
    info = SampleInfo(key=entry["key"], shard=shards[shard].name, members=tuple(members),
                      text_bytes=entry["text_bytes"], text_tokens=entry["text_tokens"],
                      images=pairs["images"], gen_images=pairs["gen_images"],
                      audio=counts["audio"], gen_audio=counts["gen_audio"])
    expected = _member_names(info)
    names = [m.name for m in members]
    if sorted(_stem(n) for n in names) != sorted(expected) or names != sorted(names):
        raise ValueError(f"members {names} do not match its sizes (expected {expected} in "
                         "name order)")
    return info


def _stem(name: str) -> str:
    """A member name without the image extension (``img0.jpg`` -> ``img0``)."""
    return name.rsplit(".", 1)[0] if name.endswith((".png", ".jpg")) else name


def _member_names(info: SampleInfo) -> list[str]:
    return (["txt", "json"] + [f"img{k}" for k in range(len(info.images))]
            + [f"gen{k}" for k in range(len(info.gen_images))]
            + [f"aud{k}.npy" for k in range(len(info.audio))]
            + [f"genaud{k}.npy" for k in range(len(info.gen_audio))])


def _parse_index(path: Path, text: bytes) -> tuple[list[_Shard], list[SampleInfo], dict]:
    try:
        doc = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DatasetError(f"corrupt index {path}: not JSON ({err})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise DatasetError(f"{path} is not a dtdsl dataset index (no \"format\": "
                           f"\"{FORMAT}\")")
    if doc.get("version") != VERSION:
        raise DatasetError(f"{path} has format version {doc.get('version')!r}; this dtc "
                           f"reads version {VERSION}")
    try:
        raw_shards, raw_samples = doc["shards"], doc["samples"]
        if not isinstance(raw_shards, list) or not isinstance(raw_samples, list):
            raise ValueError("shards and samples must be lists")
        if doc.get("num_samples") != len(raw_samples):
            raise ValueError(f"num_samples is {doc.get('num_samples')!r} but "
                             f"{len(raw_samples)} samples are listed")
        shards = []
        for k, s in enumerate(raw_shards):
            if not (isinstance(s, dict) and isinstance(s.get("name"), str)
                    and _SHARD.fullmatch(s["name"]) and _is_count(s.get("num_samples"))
                    and _is_count(s.get("size_bytes"))):
                raise ValueError(f"shard {k} is not {{name: shard-NNNNNN.tar, num_samples, "
                                 "size_bytes}")
            shards.append(_Shard(s["name"], s["num_samples"], s["size_bytes"]))
        samples = []
        for i, entry in enumerate(raw_samples):
            try:
                samples.append(_parse_sample(i, entry, shards))
            except (ValueError, TypeError) as err:
                raise ValueError(f"sample {i}: {err}") from None
        per_shard = [0] * len(shards)
        for i, entry in enumerate(raw_samples):
            per_shard[entry["shard"]] += 1
            if i and entry["shard"] < raw_samples[i - 1]["shard"]:
                raise ValueError(f"sample {i} is in an earlier shard than sample {i - 1}")
        for s, n in zip(shards, per_shard, strict=True):
            if s.num_samples != n:
                raise ValueError(f"{s.name} says {s.num_samples} samples; the index puts "
                                 f"{n} in it")
    except (ValueError, TypeError, KeyError) as err:
        raise DatasetError(f"corrupt index {path}: {err}") from None
    provenance = doc.get("provenance")
    return shards, samples, provenance if isinstance(provenance, dict) else {}
